"""Errors meant for people. A `UserError` means the input is wrong: the CLI prints it and exits with code 2."""


class UserError(Exception):
    """Wrong config, data, paths or options. The message names what and where, and says what to do."""
