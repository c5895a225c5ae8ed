"""Process program for tests/test_launch.py: ranks that fail, hang, go quiet or spawn children on purpose.

``python launch_worker.py MODE DIR [ARGS...]``. Every rank first writes its pid to ``DIR/rank{R}.pid`` so the
test can check by pid that it is gone; ``DIR`` is also on the command line of every process started here, so a
recycled pid is never mistaken for one of ours.
"""

import os
import signal
import subprocess
import sys
import time

RANK = int(os.environ["JONEBIT_PROCESS_ID"])


def write_pid(directory: str, name: str, pid: int) -> None:
    tmp = os.path.join(directory, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.replace(tmp, os.path.join(directory, name))  # the test never reads a half-written file


def sleep_forever() -> None:
    time.sleep(600)
    sys.exit(99)  # never reached when the launcher does its job


def main() -> None:
    mode, directory, *args = sys.argv[1:]
    write_pid(directory, f"rank{RANK}.pid", os.getpid())
    if mode == "sleep":
        # ARGS: "child" also starts a grandchild in this rank's process group.
        if "child" in args:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", directory])
            write_pid(directory, f"child{RANK}.pid", child.pid)
        print(f"ready {RANK}", flush=True)
        sleep_forever()
    elif mode == "fail":
        # ARGS: failing rank, exit code, "stubborn" (the others ignore SIGTERM).
        who, code = int(args[0]), int(args[1])
        if RANK == who:
            time.sleep(1.0)
            print(f"exiting at {time.time():.3f}", flush=True)
            raise SystemExit(code)
        if "stubborn" in args:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"waiting {RANK}", flush=True)
        sleep_forever()
    elif mode == "kill":
        # ARGS: the rank that SIGKILLs itself.
        if RANK == int(args[0]):
            time.sleep(1.0)
            print(f"exiting at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        sleep_forever()
    elif mode == "quiet":
        # Every rank prints one line, rank 0 a second one, then all go silent.
        print(f"step 1 on rank {RANK}", flush=True)
        if RANK == 0:
            time.sleep(0.5)
            print("step 2 on rank 0", file=sys.stderr, flush=True)
        sleep_forever()
    elif mode == "chatty":
        # Prints a line every 0.2 s: never silent, ends only by --timeout.
        for step in range(3000):
            print(f"step {step} on rank {RANK}", flush=True)
            time.sleep(0.2)
    elif mode == "flood":
        # More output than a pipe holds (64 KiB), then a file saying this rank got to the end.
        for i in range(3000):
            print(f"{i:5d} " + "x" * 80, flush=True)
        write_pid(directory, f"done{RANK}", os.getpid())
    elif mode == "jax":
        # ARGS: "exit N" | "raise N" | "hang". Rank 1 leaves with sys.exit(N) or raise SystemExit(N), or hangs,
        # once rank 0 waits in a psum.
        # A line after each slow startup step: --no-progress-timeout counts from the launch.
        print("importing jax", flush=True)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from jonebit.sharding.mesh import data_mesh, initialize_distributed

        # A rank that leaves waits in jax's shutdown barrier up to shutdown_timeout: 120 s, far beyond the 30 s
        # after which its peer's collective times out, so which of the two fails first does not depend on load.
        initialize_distributed(timeout=60, heartbeat_timeout=10, shutdown_timeout=120)
        print("initialized", flush=True)
        mesh = data_mesh()  # every process must join: creating the backend exchanges device topologies
        print("mesh ready", flush=True)
        if RANK == 1:
            flag, deadline = os.path.join(directory, "entering-psum"), time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # rank 0 is inside the psum by now
            if args[0] == "hang":
                print("hanging", flush=True)
                sleep_forever()
            print(f"exiting at {time.time():.3f}", flush=True)
            if args[0] == "raise":  # not through sys.exit: the exit code is not seen before jax's shutdown
                raise SystemExit(int(args[1]))
            sys.exit(int(args[1]))
        # The global shape is given, so building the array needs nothing from rank 1.
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones(1, np.float32), (2,))
        print("entering psum", flush=True)
        write_pid(directory, "entering-psum", os.getpid())
        jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))(x)
        print("psum returned", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
