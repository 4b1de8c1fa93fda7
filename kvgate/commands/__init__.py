"""Command-line entry points; each module adds one subcommand with `add_parser(subparsers)`."""
