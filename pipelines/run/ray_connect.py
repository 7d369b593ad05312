"""Connecting to Ray: join the named cluster (failing in seconds when it does not answer), the head `ray start`
recorded, or a local Ray listening on loopback only; with a runtime_env that lets workers import this checkout."""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import ray

from pipelines import plugins
from pipelines.console import say
from promprune.env import temporary_env

REPO = Path(__file__).resolve().parents[2]
QUIET_ENV = {"LOGURU_LEVEL": "WARNING"}  # lmms-eval logs every request build at DEBUG through loguru


def worker_env() -> dict:
    """runtime_env that lets Ray workers import `pipelines` and `promprune` from this checkout, and the sweep's
    plugins and task directories (`pipelines.plugins.runtime_env`: shipped as py_modules, named in the workers'
    environment).

    Needed for a local Ray or a cluster sharing this filesystem (tests); `ray job submit --working-dir .` puts the
    uploaded checkout on the workers' path itself, and cluster.yaml installs the project on every node.
    """

    return plugins.runtime_env({"env_vars": {"PYTHONPATH": checkout_path(), **QUIET_ENV}})


def checkout_path() -> str:
    """``PYTHONPATH`` with this checkout first: this process's entries after it, each once."""
    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(paths))


class RayUnreachable(RuntimeError):
    """The Ray cluster the user named does not answer."""


def _answers(address: str, timeout_s: float = 3.0) -> bool:
    """Whether a Ray head's GCS accepts a TCP connection at ``host:port`` within a few seconds."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _speaks_grpc(address: str, timeout_s: float = 3.0) -> bool:
    """Whether the server at ``host:port`` completes a gRPC (HTTP/2) handshake within a few seconds, as a Ray head's
    GCS does; a web server (the dashboard's port 8265) or a port that accepts and stays silent does not."""
    import grpc

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def _recorded_head() -> str | None:
    """The head a plain ``ray.init()`` would join: the address `ray start` recorded in Ray's temp dir."""
    from ray._common.utils import get_ray_address_file

    try:
        return Path(get_ray_address_file(None)).read_text().strip() or None
    except OSError:
        return None


def client_address_problem(address: str | None) -> str | None:
    """Why a sweep or an evaluation cannot run through ``address`` (or ``RAY_ADDRESS``) when it is a Ray Client
    address (``ray://host:10001``), as one paragraph; None otherwise. Asked before any work: under Ray Client the
    sweep's state API calls ran before its ``ray.init`` (a traceback) and Tune's run went to a remote task whose
    events never reached the sweep's recorder, so the sweep crashed after it had started."""
    named = address or os.environ.get("RAY_ADDRESS")
    if not named or not named.startswith("ray://"):
        return None
    source = "--address" if address else "RAY_ADDRESS"
    host = named[len("ray://"):].rpartition(":")[0] or "HEAD"
    return (f"{source}={named} is a Ray Client address, which PromPrune does not run through (Tune and the sweep's "
            "recording need the driver on the cluster: under Ray Client Tune runs in a remote task whose events the "
            "sweep never sees). Submit it to the cluster as a job instead, with the dashboard's address: `ray job "
            f"submit --address http://{host}:8265 --working-dir . -- python pipelines/sweep.py --config <spec>` "
            "(RAY_AUTH_MODE=token in front where the head enforces its token; docs/pipeline.md, \"On a cluster\"); "
            f"on a machine of the cluster, set {source} to the head's GCS address (host:6379); or unset it to run a "
            "local Ray")


def check_address(address: str | None) -> None:
    """What can be told of ``address`` (or ``RAY_ADDRESS``) without joining it, in seconds: RayUnreachable for a
    Ray Client address (`client_address_problem`: refused), a dashboard URL, and a head whose port does not answer or
    answers but not as a Ray GCS (Ray itself waits for minutes). `connect` asks it first; an entry point that
    has work to do before joining Ray (`pipelines/evaluate.py`: a model's first-use training) asks it before that."""
    named = address or os.environ.get("RAY_ADDRESS")
    source = "--address" if address else "RAY_ADDRESS"
    if not named or named in ("auto", "local"):
        return
    if problem := client_address_problem(address):
        raise RayUnreachable(problem)
    if named.startswith(("http://", "https://")):  # what `ray job submit` reads from RAY_ADDRESS
        raise RayUnreachable(f"{named} ({source}) is a Ray dashboard's URL, which `ray job submit` takes; a sweep "
                             "joins the head's GCS address (host:6379 unless `ray start --port` chose another). Set "
                             f"{source} to that on a machine of the cluster, or submit the sweep as a job (`ray job "
                             f"submit --address {named} --working-dir . -- python pipelines/sweep.py`), or leave it "
                             "unset to run a local Ray")
    if not _answers(named):
        raise RayUnreachable(f"the Ray cluster at {named} ({source}) does not answer. Start it (`ray start "
                             f"--head`), point {source} at a live head, or leave it unset to run a local Ray")
    if not _speaks_grpc(named):  # Ray itself would wait for minutes, saying nothing
        raise RayUnreachable(f"something answers at {named} ({source}), but not a Ray head's GCS: point {source} "
                             "at the head's GCS address (host:6379 unless `ray start --port` chose another; `ray "
                             "status` on the head prints it), not the dashboard's port (8265) nor Ray Client's "
                             "(10001); or submit the sweep as a job (`ray job submit --address http://HEAD:8265`)")


def connect(address: str | None, *, log_to_driver: bool = True) -> None:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``), else the head `ray start` recorded, else start a
    local Ray whose services listen on loopback only (`loopback_only`). A named head that does not answer is a
    RayUnreachable in seconds (Ray itself would wait for minutes); a recorded head that died without `ray stop` is
    skipped with a note."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR  # set by `ray job submit`

    if ray.is_initialized():
        return
    if problem := client_address_problem(address):  # a job's own RAY_ADDRESS is its head's GCS, not ray://
        raise RayUnreachable(problem)
    if os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR):  # inside `ray job submit`: the job's runtime_env, plus plugins
        extra = plugins.runtime_env({})  # Ray merges it into the job's (a field set in both is refused)
        ray.init(address=address, log_to_driver=log_to_driver, **({"runtime_env": extra} if extra else {}))
        return
    named = address or os.environ.get("RAY_ADDRESS")
    source = "--address" if address else "RAY_ADDRESS"
    check_address(address)
    if named and named not in ("auto", "local"):
        try:
            ray.init(address=named, runtime_env=worker_env(), log_to_driver=log_to_driver)
        except ConnectionError as exc:  # a head with token auth, or another gRPC server (Ray Client's port)
            raise RayUnreachable(f"the Ray head at {named} ({source}) answers but the connection failed ({exc}). A "
                                 "head started with token authentication (Ray 2.60 turns it on once ~/.ray/auth_token "
                                 "exists) needs RAY_AUTH_MODE=token here too; else point it at the head's GCS "
                                 "address (host:6379 by default), not Ray Client's port (10001)") from None
    elif named == "local":  # a new local Ray, as named
        init_local(log_to_driver=log_to_driver)
    elif named:  # auto: a running cluster on this machine
        try:
            ray.init(address=named, runtime_env=worker_env(), log_to_driver=log_to_driver)
        except ConnectionError as exc:  # no running Ray found
            raise RayUnreachable(f"no running Ray cluster was found on this machine ({source}={named}: {exc}). Start "
                                 f"one (`ray start --head`), name its GCS address (host:6379), or leave {source} "
                                 "unset to run a local Ray") from None
    else:
        recorded = _recorded_head()
        if recorded and _answers(recorded):
            ray.init(runtime_env=worker_env(), log_to_driver=log_to_driver)  # the head `ray start` left running
            return
        if recorded:
            say(f"note: the Ray head recorded at {recorded} (a `ray start` that ended without `ray stop`) does not "
                "answer; starting a local Ray instead (`ray stop --force` clears the record)")
        # a local Ray: no dashboard needed (faster start on a laptop), reachable from this machine only
        with loopback_only():
            init_local(include_dashboard=False, log_to_driver=log_to_driver)


# Ray's error when its new local node's raylet has not registered with the GCS within 30 s (a constant in Ray 2.60's
# node.py, whatever its message says of RAY_raylet_start_wait_time_s): seen on a 2-core machine whose cores other
# work held (a benchmark's Ray start during the test suite, 2026-11-28; CI's suite, twice in one test, 2026-11-28)
STARTUP_TIMEOUT = "timed out during startup"
# How long in all a local node may take to register, in place of Ray's 30 s (`patient_start`). On 2 cores with six
# busy processes beside it, a local start took 27.7 s against 8.4 s idle (2026-11-28); CI's suite saw two starts
# in a row pass 30 s. Ray's GCS answers "Deadline Exceeded" meanwhile: a busy machine, not a broken node.
STARTUP_WAIT_S = 150.0
RAY_OWN_WAIT_S = 30.0  # Ray's own
GCS_PORT_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"  # Ray's wait for a new head's GCS to write its port (30 s)


@contextlib.contextmanager
def patient_start(seconds: float | None = None):
    """While a local Ray starts: Ray's wait for its new node to register with the GCS (a fixed 30 s in Ray 2.60,
    `ray._private.node.Node.__init__` polling `ray._private.services.get_node`) lasts up to ``seconds`` instead
    (``PROMPRUNE_RAY_START_WAIT_S``, default `STARTUP_WAIT_S`): each failed poll (Ray's RuntimeError) is retried
    within that time before Ray's loop sees it. Without that hook (another Ray) Ray's own wait is left as it is. Ray's
    wait for a new head's GCS to write its port (30 s, `RAY_gcs_server_port_wait_time_s`) gets the same time unless
    that variable is set."""
    from ray._private import services

    if seconds is None:
        seconds = float(os.environ.get("PROMPRUNE_RAY_START_WAIT_S", STARTUP_WAIT_S))
    original = getattr(services, "get_node", None)
    if original is None or seconds <= 0:
        yield
        return
    start, noted = time.monotonic(), False

    def get_node(*args, **kwargs):
        nonlocal noted
        while True:
            try:
                return original(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() - start >= seconds:
                    raise
            if not noted and time.monotonic() - start > RAY_OWN_WAIT_S:
                say(f"note: Ray's new local node has not registered after {RAY_OWN_WAIT_S:.0f} s (a busy machine?); "
                    f"waiting up to {seconds:.0f} s (PROMPRUNE_RAY_START_WAIT_S)")
                noted = True
            time.sleep(0.5)

    services.get_node = get_node
    try:
        with temporary_env(**{GCS_PORT_WAIT_ENV: os.environ.get(GCS_PORT_WAIT_ENV, str(math.ceil(seconds)))}):
            yield
    finally:
        services.get_node = original


def init_local(**kwargs) -> None:
    """``ray.init`` of a new local Ray (``kwargs`` passed on) whose workers get `worker_env` by inheritance. Its node
    may take `patient_start`'s time to register; one that still did not is ended (the processes it started) and
    started once more, with a note."""
    for attempt in (1, 2):
        before = descendants()
        try:
            with inherited(worker_env()) as rest, patient_start():
                ray.init(address="local", runtime_env=rest, **kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception for it
            if attempt == 2 or STARTUP_TIMEOUT not in str(exc):
                raise
        ended = end_new_descendants(before)
        say(f"note: Ray's local node did not start in time (a busy machine?); ended what it had started "
            f"({ended} process(es)) and starting it once more")


def descendants() -> dict[tuple[int, float], object]:
    """This process's descendants (psutil processes) by (pid, creation time): a pid reused later is another process."""
    import psutil

    out = {}
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            out[proc.pid, proc.create_time()] = proc
    return out


def end_new_descendants(before) -> int:
    """Kill this process's descendants not in ``before`` (keys of `descendants`) whose command line names Ray (a
    half-started local Ray: its GCS, raylet, agents and prestarted workers; not what another thread started meanwhile)
    and reset Ray's driver state (`ray.shutdown`); returns how many were killed."""
    import psutil

    ray.shutdown()
    new = []
    for key, proc in descendants().items():
        with contextlib.suppress(psutil.Error):
            if key not in before and any("ray" in part for part in proc.cmdline()):
                proc.kill()
                new.append(proc)
    psutil.wait_procs(new, timeout=10)
    return len(new)


@contextlib.contextmanager
def inherited(runtime_env: dict):
    """While a local Ray starts: ``runtime_env``'s variables in this process's environment, which its raylet and so
    every worker inherit; yields the rest of the runtime_env (plugins' ``py_modules``), None when nothing is left.

    Ray starts a new job's first workers (one per CPU) before anything asks for them, but without the job's
    runtime_env: with variables in it, those workers sat idle and every actor and task waited for a new process
    (an actor's first call 1.8 s instead of 0.4 s on 2 cores; two idle processes, ~2 CPU-s each, per sweep). A
    cluster the sweep joins keeps the runtime_env: its workers are not this process's children."""
    with temporary_env(**runtime_env.get("env_vars", {})):
        yield {key: value for key, value in runtime_env.items() if key != "env_vars"} or None


# Ray's single-machine mode, its default on macOS and Windows: the node's IP is 127.0.0.1, so its GCS, raylet,
# workers and agents listen on loopback only (elsewhere they bind every interface, `::` / 0.0.0.0)
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_only():
    """While a local Ray starts: its processes (which read ``SINGLE_MACHINE_ENV`` when they start) and this driver
    (which read it when it imported Ray, hence the constant) take 127.0.0.1 as the node's IP, and Ray binds its
    services to the node's IP when that is loopback. Workers started later inherit the raylet's environment; a
    Ray joined at an address is untouched."""
    from ray._private import ray_constants

    before_env, before_flag = os.environ.get(SINGLE_MACHINE_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[SINGLE_MACHINE_ENV], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_flag
        if before_env is None:
            os.environ.pop(SINGLE_MACHINE_ENV, None)
        else:
            os.environ[SINGLE_MACHINE_ENV] = before_env

