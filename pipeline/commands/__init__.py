"""One module per `lpx` command: parse options, call the library, print, exit."""
