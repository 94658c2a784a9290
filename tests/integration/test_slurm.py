"""docker/slurm/shardtrain.sbatch run by a real single-node SLURM (munged, slurmctld and slurmd started here),
and `shardtrain shard --from-slurm` given SLURM's variables by hand, which needs no SLURM."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "slurm" / "shardtrain.sbatch"
SBIN_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"  # where Debian puts the daemons
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE")

# The least a one-node cluster needs, with every path in the test's directory: no cgroups (task/none,
# proctrack/linuxproc), no accounting. The node is "localhost", which resolves on any machine, so the shards'
# advertised addresses (SLURMD_NODENAME:port) do too; slurmd is told its name with -N.
SLURM_CONF = """\
ClusterName=shardtrain
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmctldPort={controller_port}
SlurmdPort={node_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={directory}/munge.socket
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=10
NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mib} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=UNLIMITED State=UP
"""


def memory_mib() -> int:
    """Nine tenths of this machine's memory: slurmd drains a node configured with more than it finds."""
    total_kib = int(re.search(r"MemTotal:\s+(\d+)", pathlib.Path("/proc/meminfo").read_text()).group(1))
    return total_kib * 9 // 10 // 1024


def environment(directory: pathlib.Path) -> dict[str, str]:
    """This process's environment for the SLURM commands and the job: our slurm.conf, shardtrain on PATH."""
    return {**os.environ, "SLURM_CONF": str(directory / "slurm.conf"),
            "PATH": f"{pathlib.Path(sys.executable).parent}:{SBIN_PATH}"}


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:g} s")
        time.sleep(0.2)


class Slurm:
    """munged, slurmctld and slurmd for one test, each in the foreground as a child of this process."""

    def __init__(self, directory: pathlib.Path):
        self.directory, self.env, self.daemons = directory, environment(directory), []
        key = directory / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for name in ("state", "spool"):
            (directory / name).mkdir()
        (directory / "slurm.conf").write_text(SLURM_CONF.format(
            host=socket.gethostname().split(".")[0], controller_port=free_port(), node_port=free_port(),
            directory=directory, cpus=os.cpu_count(), memory_mib=memory_mib()))

    def start(self) -> None:
        d = self.directory
        self._daemon("munged", "--foreground", "--force", f"--key-file={d}/munge.key", f"--socket={d}/munge.socket",
                     f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed")
        wait_until(lambda: (d / "munge.socket").exists(), 10, "munged's socket")
        self._daemon("slurmctld", "-D", "-i")
        self._daemon("slurmd", "-D", "-N", "localhost")
        try:
            wait_until(lambda: self.command("sinfo", "-h", "-N", "-o", "%T").stdout.strip() == "idle", 30,
                       "the node idle")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.logs()}") from None

    def logs(self) -> str:
        """The end of each daemon's log, for a failure's message."""
        return "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(self.directory.glob("*.log")))

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.directory / f"{name}.out", "w")
        self.daemons.append(subprocess.Popen([name, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL))
        log.close()

    def command(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=30, **kwargs)

    def job_state(self, job: str) -> dict[str, str]:
        """scontrol's fields of a job (JobState, ExitCode, ...), which it keeps a while after the job ends."""
        shown = self.command("scontrol", "show", "job", "-o", job).stdout
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    def stop(self) -> None:
        """Cancels what still runs, stops the daemons, then ends any process left with this cluster's
        SLURM_CONF in its environment (a job's tasks outlive a slurmd that is stopped first)."""
        if self.daemons and self.daemons[-1].poll() is None:
            self.command("scancel", "--full", "--user", "root")
            try:
                wait_until(lambda: not self.command("squeue", "-h").stdout.strip(), 30, "jobs ending")
            except AssertionError:
                pass
        for daemon in reversed(self.daemons):
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for pid in self._processes_of_this_cluster():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _processes_of_this_cluster(self) -> list[int]:
        marker = f"SLURM_CONF={self.env['SLURM_CONF']}\0".encode()
        found = []
        for environ in pathlib.Path("/proc").glob("[0-9]*/environ"):
            try:
                if marker in environ.read_bytes() and int(environ.parent.name) != os.getpid():
                    found.append(int(environ.parent.name))
            except (OSError, ValueError):
                continue
        return found


@pytest.fixture
def slurm(tmp_path):
    """A running single-node SLURM cluster; skipped where slurm-wlm and munge are not installed."""
    missing = [name for name in PROGRAMS if shutil.which(name, path=SBIN_PATH) is None]
    if missing:
        pytest.skip(f"SLURM is not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge, "
                    f"as .ci/run does")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start jobs (CI runs as root)")
    cluster = Slurm(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_the_batch_script_trains_the_demo_on_a_slurm_job(slurm, tmp_path):
    # No GPUs here: two CPU shards on one node, all tasks on its one allocated CPU (--overcommit). Sbatch's
    # flags override the script's #SBATCH lines; "--steps 60" goes to the demo.
    submitted = slurm.command(
        "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=1", "--overcommit", "--gpus-per-node=0",
        "--time=3", f"--output={tmp_path}/job.out",
        f"--export=ALL,SHARDS_PER_NODE=2,SHARD_PORT=0,COORDINATOR_PORT={free_port()},STARTUP_TIMEOUT=60,"
        "METRICS_PORT=0", str(SCRIPT), "--steps", "60", cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    targets, roles = tmp_path / f"shardtrain-targets-{job}.json", []

    def finished() -> bool:  # while the demo trains, every target of the discovery file answers
        if not roles and targets.exists():
            roles.extend(scraped_roles(json.loads(targets.read_text())))
            (tmp_path / "targets.json").write_text(targets.read_text())
        return slurm.job_state(job).get("JobState") in FINISHED
    try:
        wait_until(finished, 100, f"job {job} finished")
    finally:
        output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else "(no output)"
        print(output[-3000:])  # shown with a failure
    state = slurm.job_state(job)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), output[-3000:]
    ready = [json.loads(line) for line in output.splitlines() if line.startswith('{"event": "ready"')]
    assert sorted(item["service"] for item in ready) == ["coordinator", "shard", "shard"], output[-3000:]
    assert all(re.fullmatch(r"localhost:[1-9]\d*", item["address"]) for item in ready if "address" in item)
    losses = [float(value) for value in re.findall(r"step \d+: ([\d.]+)", output.split("\nloss: ")[1])]
    assert losses[-1] < losses[0] / 10, output[-3000:]
    assert "-> match" in output
    assert not list(tmp_path.glob(".shardtrain-token-*")), "the job left its token file behind"
    assert sorted(roles) == ["coordinator", "shard", "shard"], output[-3000:]
    assert not targets.exists(), "the job left its discovery file behind: Prometheus would scrape it on"
    if shutil.which("promtool"):  # the file as Prometheus' file-based discovery reads it
        config = tmp_path / "prometheus.yml"
        config.write_text(f"scrape_configs:\n  - job_name: shardtrain\n    file_sd_configs:\n"
                          f"      - files: [{tmp_path / 'targets.json'}]\n")
        checked = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True,
                                 timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def scraped_roles(groups: list[dict]) -> list[str]:
    """The role each target of a file_sd file names in its shardtrain_build_info, scraped over HTTP."""
    roles = []
    for group in groups:
        assert group["labels"].keys() == {"slurm_job_id"}
        for target in group["targets"]:
            assert re.fullmatch(r"localhost:[1-9]\d*", target), target
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as answer:
                roles += re.findall(r'^shardtrain_build_info{.*role="(\w+)".*} 1\.0$', answer.read().decode(),
                                    re.MULTILINE)
    return roles


def test_shards_from_slurm_variables_register_where_they_say_and_the_demo_trains_on_them(tmp_path):
    # What srun would set for two tasks on one node, given by hand: the shards listen on every interface at
    # ports the OS picks (--port 0) and advertise SLURMD_NODENAME with them.
    token = tmp_path / "token"
    token.write_text("slurm-test-token")
    env = {**os.environ, "SHARDTRAIN_AUTH_TOKEN_FILE": str(token), "SLURM_JOB_NODELIST": "localhost",
           "SLURMD_NODENAME": "localhost", "SLURM_JOB_ID": "1"}
    coordinator = subprocess.Popen(["shardtrain", "coordinator", "--bind", "127.0.0.1:0"], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    shards = []
    try:
        port = json.loads(coordinator.stdout.readline())["port"]
        for local_id in range(2):
            shards.append(subprocess.Popen(
                ["shardtrain", "shard", "--from-slurm", "--coordinator-port", str(port), "--port", "0"],
                env={**env, "SLURM_LOCALID": str(local_id)}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True))
        addresses = [json.loads(shard.stdout.readline())["address"] for shard in shards]
        assert all(re.fullmatch(r"localhost:[1-9]\d*", address) for address in addresses), addresses
        done = subprocess.run(["shardtrain", "demo", "--coordinator", f"localhost:{port}", "--shards", "2",
                               "--steps", "10", "--wait", "30"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert all(address in done.stdout for address in addresses) and "-> match" in done.stdout
    finally:
        for process in [*shards, coordinator]:
            process.terminate()
        for process in [*shards, coordinator]:
            process.wait(timeout=30)


def test_a_shard_outside_a_slurm_job_says_which_variable_is_missing():
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM")}
    done = subprocess.run(["shardtrain", "shard", "--from-slurm"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--from-slurm: SLURM_JOB_NODELIST is not set" in done.stderr
