"""tformer's exceptions: one base class, so that a caller (the CLI, a server) catches every user-caused error.

Each message says what was wrong and how to fix it. Each class also derives from the builtin a caller would
catch without knowing tformer (ValueError for bad values, RuntimeError for failures while running).
"""


class TformerError(Exception):
    """Base of every error tformer raises for something the user can fix (a config, a file, a request)."""


class ConfigError(TformerError, ValueError):
    """A config value is invalid; the message says which one and how to fix it."""


class CheckpointError(TformerError, RuntimeError):
    """A checkpoint directory is missing, incomplete or does not match its config."""


class DataError(TformerError, ValueError):
    """Input data the user supplied (or the embedded corpus) cannot be read; the message says how to fix it."""


class RequestError(TformerError, ValueError):
    """A request the engine cannot serve (bad sampling parameters, a prompt that does not fit, ...)."""


class TrainingDiverged(TformerError, RuntimeError):
    """The loss or gradient became NaN or infinite; the last good checkpoint is kept."""


class DistributedFailure(TformerError, RuntimeError):
    """A collective failed or timed out: another rank died, hung or was stopped."""


class TrainingOutOfMemory(TformerError, RuntimeError):
    """A training step could not allocate memory; the last good checkpoint is kept."""
