"""The `splitserve` command line: argv in, typed configs out; each command hands them to its service."""
