#!/usr/bin/env python3
"""Runs the standalone Envoy under hot restart (rendered by gatewayctl, envoy.hot_restart).

Usage: hot-restarter.py START_SCRIPT

Runs START_SCRIPT (start-envoy.sh) with RESTART_EPOCH=0. On SIGHUP it first checks the config
with the same command line and `--mode validate`: a config Envoy refuses starts no epoch (the
running one serves on; Envoy refuses every later hot restart once a new epoch failed while
starting: "previous envoy process is still initializing", and only a full restart clears that).
Then it runs START_SCRIPT with the next epoch: that Envoy takes the listeners over from the running
one, which drains and exits by itself (--drain-time-s, --parent-shutdown-time-s). On SIGTERM or
SIGINT it passes SIGTERM to every epoch, waits for them and exits 0. When the newest epoch exits
while an older one still runs (it did not start), the older one keeps serving; when no epoch runs,
it exits with the newest one's status (the systemd unit restarts it). Every epoch gets SIGTERM when
this process dies.
"""

import ctypes
import os
import signal
import subprocess
import sys

HANDLED = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1


def log(message: str) -> None:
    print(f"hot-restarter: {message}", flush=True)


def child_setup() -> None:
    """In each epoch before exec: the signals this process waits for unblocked again, and
    SIGTERM when this process dies (Linux)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass


class Restarter:
    def __init__(self, start_script: str):
        self.start_script = start_script
        self.running: list[tuple[int, subprocess.Popen]] = []  # oldest first
        self.next_epoch = 0

    def config_valid(self) -> bool:
        """Whether Envoy accepts the next epoch's config (`--mode validate`, nothing started)."""
        env = dict(os.environ, RESTART_EPOCH=str(self.next_epoch))
        check = subprocess.run(["/bin/sh", self.start_script, "--mode", "validate"], env=env,
                               preexec_fn=child_setup, capture_output=True, text=True, timeout=120)
        if check.returncode != 0:
            log(f"epoch {self.next_epoch} not started: the config does not validate "
                f"({check.returncode}):\n{check.stdout}{check.stderr}")
        return check.returncode == 0

    def start_epoch(self) -> None:
        epoch = self.next_epoch
        env = dict(os.environ, RESTART_EPOCH=str(epoch))
        child = subprocess.Popen(["/bin/sh", self.start_script], env=env, preexec_fn=child_setup)
        self.running.append((epoch, child))
        self.next_epoch = epoch + 1
        log(f"epoch {epoch} started (pid {child.pid})")

    def reap(self) -> int | None:
        """Forgets the epochs that exited; the newest one's status when it exited."""
        newest = self.running[-1] if self.running else None
        status = None
        for entry in list(self.running):
            epoch, child = entry
            code = child.poll()
            if code is None:
                continue
            self.running.remove(entry)
            log(f"epoch {epoch} exited with status {code}")
            if entry is newest:
                status = code
                # The epochs still running are older: the next SIGHUP retries this number.
                self.next_epoch = epoch
        return status

    def stop(self) -> int:
        for epoch, child in self.running:
            log(f"stopping epoch {epoch} (pid {child.pid})")
            child.send_signal(signal.SIGTERM)
        for _, child in self.running:
            child.wait()
        return 0


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: hot-restarter.py START_SCRIPT", file=sys.stderr)
        return 2
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    restarter = Restarter(sys.argv[1])
    restarter.start_epoch()
    while True:
        received = signal.sigtimedwait(HANDLED, 0.2)
        if received is not None and received.si_signo == signal.SIGHUP:
            if restarter.config_valid():
                restarter.start_epoch()
        elif received is not None:
            return restarter.stop()
        status = restarter.reap()
        if not restarter.running:
            log("no epoch runs")
            return 1 if status is None else status


if __name__ == "__main__":
    sys.exit(main())
