from __future__ import annotations


class SpecError(ValueError):
    """Invalid input, found before anything is launched.

    The message always names the file, the key path and the fix, so a user can act on it
    without reading our code.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        key: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.file = file
        self.key = key
        self.fix = fix
        self.detail = message
        parts = []
        if file:
            parts.append(str(file))
        if key:
            parts.append(f"key '{key}'")
        head = ": ".join(parts)
        text = f"{head}: {message}" if head else message
        if fix:
            text += f"\n  fix: {fix}"
        super().__init__(text)


class NotRunnableHere(SpecError):
    """A valid pair that this session cannot run: it needs more devices than the session has,
    or a backend that is not installed. Collection skips it with this message as the reason
    (``--convergence-strict`` makes it an error, like every other SpecError)."""


class RunFailed(Exception):
    """A run that did not give what was asked of it (a job crashed, a pair could not run):
    not the input's fault, so not a :class:`SpecError`. The message says what failed and where
    its logs are."""
