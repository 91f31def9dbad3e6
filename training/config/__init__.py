"""Reading and checking the config: the YAML loader, the parser's errors, and the checks before anything starts."""
