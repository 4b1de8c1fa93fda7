"""The one-command demo: round robin vs cache-aware routing over mock engines, in one process."""
