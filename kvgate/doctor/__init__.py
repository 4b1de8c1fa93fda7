"""`kvgate doctor`: checks a running deployment agrees with the gateway's configuration."""
