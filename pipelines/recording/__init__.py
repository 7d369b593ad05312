"""Recording: a sweep in MLflow, in the schema of `pipelines.mlflow_layout` (what `pipelines/report.py` reads back),
and on the console. Only the driver writes; trials hand their results back through Ray Tune.

    recorder.py        SweepRecorder: each trial's run from its start to its end, the parent run's writes
    outbox.py          Outbox: the one MLflow writer (a thread of the driver), writes kept on disk while the store
                       is down, none dropped for want of its run
    callback.py        RecorderHook: Tune's trial events to the recorder attached around Tune's run (`attached`)
    results.py         SweepResults: each trial's record, Rel. against the baseline, the samples generated
    console.py         SweepConsole (a line per trial, the progress bar) and the closing summary (table, paired
                       differences, the best (mu, tau))
    tracking.py        direct MLflow reads and writes: the client, the parent run, whole runs, the nightly check
    view.py            the sweep's saved view of the MLflow runs page
    system_metrics.py  the driver's CPU and memory on the parent run

docs/pipeline.md ("What MLflow holds", and why not Ray's own MLflow integration) says how the parts fit.
"""
