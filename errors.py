"""The error a run reports as a usage problem (bad flags, paths, data): one line on stderr and exit code 2, printed
by `run_utils.main_guard`, never a traceback. Every module raises it as `errors.UserError` (imported one way:
`from errors import UserError`)."""


class UserError(ValueError):
    """Bad input from the command line or data: printed as one line by `run_utils.main_guard`, exit code 2."""
