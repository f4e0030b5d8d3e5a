"""nginx and Prometheus, the real Debian binaries, started on 127.0.0.1 with the committed configurations.

`.ci/run` installs both through apt. Outside CI a machine without them skips these tests and says why; under
CI (`CI` set) a missing binary fails them, so the checks never silently stop running.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import httpx
import pytest
import yaml

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


def binary(name: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)),
                                      None)
    if path is None:
        message = f"`{name}` is not installed (apt-get install {'nginx-light' if name == 'nginx' else name})"
        if os.environ.get("CI"):
            pytest.fail(message + "; .ci/run installs it")
        pytest.skip(message)
    return path


def _wait(url: str, proc: subprocess.Popen, log: pathlib.Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(url, timeout=1)
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def nginx_config(listen_port: int, replica_ports: list[int]) -> str:
    """deploy/nginx/paged.conf with its listen port and upstream servers replaced, everything else as
    committed."""
    text = (DEPLOY / "nginx" / "paged.conf").read_text()
    servers = re.findall(r"^( *)server 127\.0\.0\.1:\d+( [^;]*);$", text, flags=re.M)
    assert servers, "the committed upstream lists no servers"
    indent, params = servers[0]
    text = re.sub(r"^ *server 127\.0\.0\.1:\d+[^;]*;\n", "", text, flags=re.M)
    upstream = "".join(f"{indent}server 127.0.0.1:{p}{params};\n" for p in replica_ports)
    text = text.replace("    least_conn;\n", "    least_conn;\n" + upstream, 1)
    return re.sub(r"listen \d+;", f"listen 127.0.0.1:{listen_port};", text)


@contextlib.contextmanager
def nginx(workdir: pathlib.Path, listen_port: int, replica_ports: list[int]):
    exe = binary("nginx")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "paged.conf").write_text(nginx_config(listen_port, replica_ports))
    temp = "".join(f"  {kind}_temp_path {workdir / kind};\n" for kind in ("client_body", "proxy", "fastcgi",
                                                                          "uwsgi", "scgi"))
    (workdir / "nginx.conf").write_text(
        f"worker_processes 1;\npid {workdir / 'nginx.pid'};\nerror_log {workdir / 'error.log'} info;\n"
        f"events {{ worker_connections 512; }}\n"
        f"http {{\n  access_log {workdir / 'access.log'};\n{temp}  include {workdir / 'paged.conf'};\n}}\n")
    test = subprocess.run([exe, "-t", "-p", str(workdir), "-c", str(workdir / "nginx.conf")],
                          capture_output=True, text=True)
    assert test.returncode == 0, test.stderr
    log = workdir / "error.log"
    proc = subprocess.Popen([exe, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{listen_port}/health", proc, log)
        yield f"http://127.0.0.1:{listen_port}"
    finally:
        _stop(proc)


def prometheus_config(targets: list[str], scrape_interval: str) -> dict:
    """deploy/prometheus/prometheus.yml with its targets and intervals replaced."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = scrape_interval
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": targets}]
    return config


@contextlib.contextmanager
def prometheus(workdir: pathlib.Path, port: int, targets: list[str], scrape_interval: str = "1s"):
    exe = binary("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(targets, scrape_interval)))
    log = workdir / "prometheus.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([exe, f"--config.file={workdir / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{port}/-/ready", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)
