"""From records to readers: one table of every job (``collect``) and the report with its
figures (``build``)."""


def __getattr__(name: str):
    # `from harness import report; report.plot_latency(df)` (the notebook's spelling) without
    # importing matplotlib for callers that only need `collect`.
    import importlib

    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module("harness.report.build"), name)
