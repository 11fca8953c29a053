"""The error a run reports as a usage problem (bad flags, paths, data): one line on stderr and exit code 2, printed
by `run_utils.main_guard`, never a traceback. Every module raises it as `errors.UserError` (imported one way:
`from errors import UserError`)."""


class UserError(ValueError):
    """Bad input from the command line or data: printed as one line by `run_utils.main_guard`, exit code 2."""


class RolloutError(UserError):
    """A rollout cannot go on, on every process together (a reward function failed, the sampler's log-probs are not
    the trainer's): the RL scripts checkpoint their finished steps first (train_loop.checkpoint_on_error)."""


def require_positive(flags, *names: str) -> None:
    """A UserError naming the first of the flags `names` whose value is not > 0 (a None is a flag left unset: fine)."""
    for name in names:
        value = getattr(flags, name)
        if value is not None and not value > 0:
            raise UserError(f"--{name} must be > 0, got {value}")
