"""Progress of long steps on the command line: one transient rich line on stderr, shown only
when stderr is a terminal (pipes and logs get nothing)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def step_progress(first: str = "") -> Iterator[Callable[..., None]]:
    """Yield ``report(step, completed=None, total=None)``: the line shows the step, a bar
    (pulsing while the total is unknown) and the time elapsed; it is erased at the end."""
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda *args, **kwargs: None
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(first, total=None)

        def report(step: str, completed: int | None = None, total: int | None = None) -> None:
            bar.update(task, description=step, completed=completed or 0, total=total)

        yield report
