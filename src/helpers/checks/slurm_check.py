"""``make slurm-check``: a real Slurm, started on this machine, runs examples/slurm/finetune-cpu.sbatch and preempts it.

1. Debian's slurm-wlm and munge, installed with apt-get where missing (so: root, on Debian or Ubuntu).
2. munged with a key of its own, slurmctld, and two slurmd, each in a network namespace of its own with its own
   address and host name (node1, node2): two nodes that talk over a network, as two machines do. Where network
   namespaces cannot be made, one node that runs both processes.
3. The CPU sbatch script, submitted as a reader submits it. Once its first checkpoint exists, ``scontrol requeue``:
   SIGTERM to every process, as when Slurm preempts a job. Once the requeued run has saved again, USR1 to the batch
   shell, as ``--signal=B:USR1@60`` sends before the time limit: the script then stops the run and requeues the job
   itself. Slurm holds a requeued job for about two minutes before it may start again; the check lets it start at once.
4. The finished job's result against a one-machine DDP run of the same arguments (torchrun --standalone, 2
   processes): every rank's weights, bitwise, and every epoch's losses.
5. Every daemon it started is stopped by its process id; the namespaces and the working folder are removed (the
   folder is kept, and named, when the check fails).

Prints a transcript as it goes and exits 1 if the resumed result differs or anything fails. Not part of ``make test``
(about two minutes, and root); CONTRIBUTING.md records the last run.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers.checks.training_checks import RUN_ENV, finetune_command, run, summary_of
from helpers.launch import last_json

ROOT = Path(__file__).resolve().parents[3]
SBATCH = "examples/slurm/finetune-cpu.sbatch"
TRAINING = ["--train-examples", "128", "--global-batch-size", "8", "--epochs", "3"]
SAVE_EVERY = ["--save-every", "4"]
PACKAGES = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm", "munged": "munge"}
TIMEOUT = 600


class CheckFailed(Exception):
    """What went wrong, in one line."""


def say(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


def sh(*command: str, **options) -> subprocess.CompletedProcess:
    """Run ``command``; CheckFailed with its stderr if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, **options)
    if done.returncode:
        raise CheckFailed(f"{' '.join(command)}: exit status {done.returncode}: {done.stderr.strip()[-500:]}")
    return done


def install_missing() -> None:
    """apt-get install the Debian packages of the programs that are not on PATH."""
    missing = sorted({package for program, package in PACKAGES.items() if shutil.which(program) is None})
    if not missing:
        return
    say(f"installing {' '.join(missing)} (apt-get)")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    sh("apt-get", "update", "-qq", env=env)
    sh("apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing, env=env)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class Cluster:
    """munged, slurmctld and the slurmd of each node, started in ``work``; ``stop`` ends each of them by its pid."""

    def __init__(self, work: Path):
        self.work, self.tag = work, f"sc{os.getpid() % 100000}"
        self.namespaces: list[str] = []
        self.bridge: str | None = None
        self.pid_files: list[tuple[str, Path]] = []
        self.nodes: list[tuple[str, str]] = []  # (name, address)
        self.env = os.environ | {"SLURM_CONF": str(work / "slurm.conf")}

    def start(self) -> None:
        self.start_munge()
        subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        try:
            self.make_namespaces(subnet)
            self.nodes = [("node1", f"{subnet}.11"), ("node2", f"{subnet}.12")]
            controller, cpus = f"{subnet}.1", 1
        except CheckFailed as error:
            say(f"no network namespaces here ({error}); one node runs both processes")
            self.remove_namespaces()
            self.nodes, controller, cpus = [(socket.gethostname(), "127.0.0.1")], "127.0.0.1", 2
        self.write_config(controller, cpus)
        sh("slurmctld", "-f", str(self.work / "slurm.conf"), env=self.env)
        self.pid_files.append(("slurmctld", self.work / "slurmctld.pid"))
        for index, (name, address) in enumerate(self.nodes):
            command = f"exec slurmd -f {self.work / 'slurm.conf'} -N {name}"
            if self.namespaces:  # its own network, host name and /etc/hosts, as a machine of the cluster has
                command = (f"mount --bind {self.work / 'hosts'} /etc/hosts && hostname {name} && " + command)
                sh("nsenter", f"--net=/run/netns/{self.namespaces[index]}", "unshare", "--mount", "--uts",
                   "--propagation", "private", "sh", "-c", command, env=self.env)
            else:
                sh("sh", "-c", command, env=self.env)
            self.pid_files.append((f"slurmd {name}", self.work / f"slurmd.{name}.pid"))
        self.wait_until_idle()
        kind = "network namespaces" if self.namespaces else "this machine's own network"
        say(f"Slurm {self.version()}: {len(self.nodes)} node(s), "
            + ", ".join(f"{name} {address}" for name, address in self.nodes) + f" ({kind}), {cpus} CPU(s) each")

    def start_munge(self) -> None:
        folder = self.work / "munge"
        folder.mkdir()
        key = folder / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        shutil.chown(folder, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        folder.chmod(0o711)  # munged wants its socket's folder searchable by everyone
        key.chmod(0o400)
        sh("runuser", "-u", "munge", "--", "munged", f"--key-file={key}", f"--socket={folder / 'munge.socket'}",
           f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'munged.log'}",
           f"--seed-file={folder / 'munged.seed'}")
        self.pid_files.append(("munged", folder / "munged.pid"))

    def make_namespaces(self, subnet: str) -> None:
        self.bridge = f"{self.tag}br"
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{subnet}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for number in (1, 2):
            namespace, veth = f"{self.tag}n{number}", f"{self.tag}v{number}"
            sh("ip", "netns", "add", namespace)
            self.namespaces.append(namespace)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            sh("ip", "link", "set", veth, "master", self.bridge, "up")
            sh("ip", "-n", namespace, "addr", "add", f"{subnet}.1{number}/24", "dev", "eth0")
            sh("ip", "-n", namespace, "link", "set", "eth0", "up")
            sh("ip", "-n", namespace, "link", "set", "lo", "up")

    def write_config(self, controller: str, cpus: int) -> None:
        (self.work / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for name, address in self.nodes) + f"{controller} {socket.gethostname()}\n")
        spool = self.work / "spool"
        spool.mkdir()
        nodes = "".join(f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN\n" for name, address in self.nodes)
        (self.work / "slurm.conf").write_text(f"""\
ClusterName=slurmcheck
SlurmctldHost={socket.gethostname()}({controller})
SlurmUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={self.work / 'munge' / 'munge.socket'}
StateSaveLocation={self.work / 'state'}
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={self.work / 'slurmctld.pid'}
SlurmdPidFile={self.work}/slurmd.%n.pid
SlurmctldLogFile={self.work / 'slurmctld.log'}
SlurmdLogFile={self.work}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=30
{nodes}PartitionName=check Nodes={','.join(name for name, _ in self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def version(self) -> str:
        return sh("sinfo", "--version", env=self.env).stdout.split()[-1]

    def wait_until_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                    env=self.env).stdout.split()
            if len(states) == len(self.nodes) and set(states) == {"idle"}:
                return
            if time.monotonic() > deadline:
                raise CheckFailed(f"the nodes are {states or 'not known'} after {timeout:.0f} s, not idle: see "
                                  f"{self.work}/slurmd.*.log")
            time.sleep(0.5)

    def job_state(self, job: str) -> dict[str, str]:
        shown = sh("scontrol", "show", "job", job, env=self.env).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def stop(self) -> list[str]:
        """Stop every daemon this check started (slurmd, slurmctld, munged), by its pid, and remove the namespaces;
        returns what it stopped and removed."""
        done = []
        for name, pid_file in reversed(self.pid_files):
            try:
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.1)
            done.append(f"{name} ({pid})")
        if self.namespaces:
            done.append(f"network namespaces {' '.join(self.namespaces)}")
        self.remove_namespaces()
        return done

    def remove_namespaces(self) -> None:
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.namespaces, self.bridge = [], None


def wait_for(what: str, ready, timeout: float = TIMEOUT, every: float = 0.2):
    """``ready()``'s first true value; CheckFailed naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)
    return value


def latest(checkpoints: Path) -> str | None:
    try:
        return (checkpoints / "latest").read_text().strip() or None
    except OSError:
        return None


def step_of(name: str) -> int:
    return int(name.split("-")[1])


def restart_now(cluster: Cluster, job: str, restarts: int) -> None:
    """Wait until the job is back in the queue after its ``restarts``-th requeue and its nodes are idle again, then
    let it start at once. Slurm holds a requeued job for about two minutes; started before the old run's batch
    shell has ended, the new run would be charged with that shell's exit status (seen here: the job ended FAILED)."""
    wait_for(f"job {job} requeued", lambda: (state := cluster.job_state(job))["JobState"] == "PENDING"
             and int(state["Restarts"]) == restarts)
    cluster.wait_until_idle()
    sh("scontrol", "update", f"JobId={job}", "StartTime=now", env=cluster.env)


def preempt_and_finish(cluster: Cluster, work: Path) -> tuple[str, dict]:
    """Submit the CPU sbatch, preempt it twice, wait for it to finish; its output and final summary."""
    checkpoints, output = work / "checkpoints", work / "job.out"
    one_node = len(cluster.nodes) == 1
    env = cluster.env | RUN_ENV | {"CHECKPOINT_DIR": str(checkpoints)} | ({"NPROC_PER_NODE": "2"} if one_node else {})
    options = ["--nodes=1"] if one_node else []
    job = sh("sbatch", "--parsable", f"--output={output}", *options, SBATCH, *TRAINING, *SAVE_EVERY, cwd=ROOT,
             env=env).stdout.strip()
    say(f"job {job}: sbatch {' '.join(options + [SBATCH] + TRAINING + SAVE_EVERY)}")

    def resumed_at(run: int) -> int | None:
        """The step the job's ``run``-th run resumed at (run 2 is the first requeued one), once it has said so."""
        steps = re.findall(r"^resumed at step (\d+)", output.read_text(errors="replace"), re.MULTILINE)
        return int(steps[run - 2]) if len(steps) >= run - 1 else None

    first = wait_for("the first checkpoint", lambda: latest(checkpoints))
    sh("scontrol", "requeue", job, env=cluster.env)
    say(f"run 1 saved {first}; scontrol requeue {job}: SIGTERM to every process, as a preemption")
    restart_now(cluster, job, 1)
    stopped = wait_for("run 2 resuming", lambda: resumed_at(2))
    second = wait_for("a checkpoint of run 2", lambda: (name := latest(checkpoints)) and step_of(name) > stopped
                      and name)
    sh("scancel", "--batch", "--signal=USR1", job, env=cluster.env)
    say(f"run 2 resumed at step {stopped}, saved {second}; USR1 to the batch shell, as --signal=B:USR1@60 sends "
        f"before the time limit")
    restart_now(cluster, job, 2)

    state = wait_for(f"job {job} finished", lambda: (s := cluster.job_state(job))["JobState"] in
                     ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") and s)
    text = output.read_text(errors="replace")
    if state["JobState"] != "COMPLETED":
        raise CheckFailed(f"job {job} ended {state['JobState']} (exit code {state.get('ExitCode')}): see {output}")
    say(f"job {job}: COMPLETED after {state['Restarts']} requeues, run 3 resumed at step {resumed_at(3)}")
    return text, last_json(text)


def transcript(text: str) -> list[str]:
    """The job's own lines that tell its story: each run's command, stops, resumptions, requeues."""
    keep = re.compile(r"job \d+, run \d+|: every process saves|^stopped by|^resumed at|requeued:|^epoch \d+:")
    return [line for line in text.splitlines() if keep.search(line)]


def compare(resumed: dict, reference: dict) -> tuple[bool, str]:
    same_weights = resumed["weights_sha256"] == reference["weights_sha256"] and len(set(resumed["weights_sha256"])) == 1
    losses = [[(row["train_loss"], row["val_loss"]) for row in result["history"]] for result in (resumed, reference)]
    ok = same_weights and losses[0] == losses[1]
    return ok, (f"preempted twice and resumed on Slurm vs one machine without a stop: weights of all "
                f"{len(resumed['weights_sha256'])} ranks bitwise equal: {same_weights}; every epoch's losses equal: "
                f"{losses[0] == losses[1]}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.checks.slurm_check", description=__doc__.split("\n\n")[0])
    parser.parse_args()
    if os.geteuid() != 0:
        print("slurm-check: needs root (apt-get, network namespaces, Slurm's daemons); run it as root", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="slurm-check-"))
    work.chmod(0o755)
    cluster, ok = Cluster(work), False
    started = time.monotonic()
    try:
        install_missing()
        cluster.start()
        text, resumed = preempt_and_finish(cluster, work)
        for line in transcript(text):
            say(f"  | {line[:200]}")
        reference = summary_of(run(finetune_command(2, "--device", "cpu", *TRAINING)))
        ok, line = compare(resumed, reference)
        say(line)
    except (CheckFailed, subprocess.SubprocessError, OSError, ValueError, KeyError) as error:
        say(f"failed: {error}")
    finally:
        stopped = cluster.stop()
        say(f"stopped {', '.join(stopped) or 'nothing'}")
        if ok:
            shutil.rmtree(work)
        else:
            say(f"kept {work} (logs, job output, checkpoints)")
    say(f"slurm-check {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
