"""The parts of a sweep and of one evaluation, by concern (the entry points are `pipelines/sweep.py` and
`pipelines/evaluate.py`); a trial reads trial.py -> engine.py -> workers.py -> result.py ->
`pipelines/recording/`:

    trial.py         a trial in its Tune actor: a light coordinator that takes its `Trial` from Tune, evaluates it,
                     reports progress and its result (and `alone`: one evaluation without Tune)
    engine.py        a trial's side of the evaluation: its blocks to the sweep's model workers, one per idle worker
    workers.py       the sweep's model workers (actors holding the model for every trial), failover, the driver's pool
    pool.py          the pool's roster: leases, one block per idle worker, retirement, attempts (a light named actor)
    result.py        TrialResult: a trial's predictions, scores and metrics, one parquet file from trial to MLflow
    requests.py      the requests as sealed blocks in the object store (built on the driver or in shards)
    checkpoints.py   a trial's answered blocks, saved as they come back (resume, retries)
    search.py        Tune as a search: the trial in Tune's config, searchers, ASHA, what a searched trial computes
    resources.py     GPU or CPU, workers per trial and per pool, trials at once, the autoscaler, waiting for GPUs
    ray_connect.py   joining (or starting) Ray, the workers' runtime_env
    state.py         a sweep's saved state, --resume, one driver per sweep
    fake_cluster.py  an autoscaling Ray cluster on one machine (tests, benchmarks/sweep_scaling.py --autoscale)

The driver's MLflow logging of the trials and the console's summary are `pipelines/recording/`.
"""
