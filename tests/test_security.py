"""Nobody gets in where they do not belong (issue 17):

- `featcal server start` off loopback requires Prefect's basic authentication (or an explicit --insecure): a
  server on 0.0.0.0, reached through 127.0.0.1, answers 401 without the secret and 200 with it, and a
  `featcal run` that finds the secret under FEATCAL_HOME completes against it;
- a Dask cluster reached with `--address tls://…` and a CA made here (mutual TLS) runs the pipeline, and
  clients without a certificate are refused;
- a credential planted in `runtime.storage_options` (through --set) appears in clear in no file of the run
  directory, no log, and nowhere in the server's API (flow-run parameters, task runs, logs, artifacts, events),
  while the config fingerprint still changes with it.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import secrets
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from featcal import secrets as featcal_secrets
from featcal.config import load_config
from flows import deploy, server
from flows.cli import main
from flows.dask_runner import DaskUnavailable, check_tls
from storage.rundir import RunDir
from tests.dask_processes import dask_processes
from tests.prefect_helpers import wait_for

pytest_plugins = ("tests.s3_server",)

ROOT = Path(__file__).resolve().parent.parent
STAGES = 1 + 3 + 3 * (3 + 1) + 2 * 3 + 1  # tiny BERT without evaluation: merge, prepares, blocks, assemble


# ---- helpers ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def auth_server(tmp_path_factory) -> Iterator[server.ServerInfo]:
    """A featcal server on every interface (0.0.0.0): authentication on by default. Reached through 127.0.0.1."""
    home = tmp_path_factory.mktemp("auth-home")
    info, started = server.start(home, host="0.0.0.0", port=0)
    assert started and info.auth
    try:
        yield info
    finally:
        server.stop(home)


def _base(info: server.ServerInfo) -> str:
    return f"http://127.0.0.1:{info.port}"


def _basic(info: server.ServerInfo) -> httpx.BasicAuth:
    user, password = server.auth_secret(Path(info.home)).split(":", 1)
    return httpx.BasicAuth(user, password)


def _env(info: server.ServerInfo) -> dict[str, str]:
    """A user's shell: FEATCAL_HOME names the server, no Prefect API settings of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_", "PREFECT_SERVER_API_AUTH"))}
    env.update({"FEATCAL_HOME": info.home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1",
                "OMP_NUM_THREADS": "1"})
    env.pop(featcal_secrets.ENV_VAR, None)
    return env


def _featcal(*args: str, env: dict[str, str], timeout: float = 400) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def _flow_run_id(out: str) -> str:
    return re.search(r"flow run: \S+/runs/flow-run/([0-9a-f-]+)", out)[1]


def _api_texts(info: server.ServerInfo, flow_run_id: str) -> dict[str, str]:
    """Everything the API tells about a flow run, as text: parameters, task runs, logs, artifacts, events."""
    auth, base = _basic(info), _base(info)
    by_run = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    out = {"flow run": httpx.get(f"{base}/api/flow_runs/{flow_run_id}", auth=auth, timeout=30).text}
    for name, path, body in [
        ("task runs", "/api/task_runs/filter", {**by_run, "limit": 200}),
        ("logs", "/api/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}),
        ("artifacts", "/api/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}),
        ("events", "/api/events/filter", {"limit": 50}),
    ]:
        response = httpx.post(f"{base}{path}", json=body, auth=auth, timeout=30)
        assert response.status_code == 200, (name, response.text)
        out[name] = response.text
    page = json.loads(out["events"])
    assert page["events"], "no events: the grep below would prove nothing"
    while page.get("next_page"):  # every event of the last day, page by page
        response = httpx.get(page["next_page"], auth=auth, timeout=30)
        assert response.status_code == 200, response.text
        out["events"] += response.text
        page = response.json()
    more = json.loads(out["logs"])
    offset = 200
    while len(more) == 200:  # every log line, not the first page only
        response = httpx.post(f"{base}/api/logs/filter", auth=auth, timeout=30, json={
            "logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200, "offset": offset})
        more = response.json()
        out["logs"] += response.text
        offset += 200
    return out


def _files_containing(root: Path, needle: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and needle.encode() in p.read_bytes())


def _planted() -> str:
    return f"PLANTED-{secrets.token_hex(8)}"


def _store_overrides(bucket: str, options: dict) -> list[str]:
    return ["--set", "evaluation.enabled=false", "--set", f"runtime.activation_store=s3://{bucket}/run",
            "--set", f"runtime.storage_options={json.dumps(options)}"]


# ---- the server -------------------------------------------------------------------------------------------------
def test_off_loopback_without_auth_is_refused_unless_insecure(tmp_path, capsys):
    with pytest.raises(server.ServerError, match="refusing to listen on 0.0.0.0 without authentication.*--insecure"):
        server.start(tmp_path / "home", host="0.0.0.0", port=0, auth=False)
    assert not (tmp_path / "home" / server.STATE_FILE).exists()  # nothing was started
    with pytest.raises(SystemExit):
        main(["server", "start", "--auth", "--insecure", "--home", str(tmp_path / "home")])
    assert "not allowed with argument" in capsys.readouterr().err
    assert server.is_loopback("127.0.0.1") and server.is_loopback("::1") and server.is_loopback("localhost")
    assert not server.is_loopback("0.0.0.0") and not server.is_loopback("10.1.2.3")


def test_server_off_loopback_answers_401_without_the_secret_and_200_with_it(auth_server, capsys):
    base, home = _base(auth_server), Path(auth_server.home)
    secret_file = server.auth_file(home)
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    secret = server.auth_secret(home)
    assert json.loads((home / server.STATE_FILE).read_text())["auth"] is True
    assert secret not in (home / server.STATE_FILE).read_text() and secret not in (home / server.LOG_FILE).read_text()

    query = {"limit": 1}
    assert httpx.post(f"{base}/api/flows/filter", json=query, timeout=30).status_code == 401
    assert httpx.post(f"{base}/api/flows/filter", json=query, timeout=30,
                      auth=httpx.BasicAuth("featcal", "wrong")).status_code == 401
    assert httpx.post(f"{base}/api/flows/filter", json=query, timeout=30, auth=_basic(auth_server)).status_code == 200
    assert httpx.get(f"{base}/api/health", timeout=30).status_code == 200  # probes need no secret
    assert httpx.get(f"{base}/ui-settings", timeout=30).json()["auth"] == "BASIC"  # the UI asks for the secret

    # The events websocket (what workers and the UI stream over) checks the same secret in this Prefect.
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{auth_server.port}/api/events/out", subprotocols=["prefect"], open_timeout=30) as ws:
        ws.send(json.dumps({"type": "auth", "token": "featcal:wrong"}))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd.code == 1008
    with connect(f"ws://127.0.0.1:{auth_server.port}/api/events/out", subprotocols=["prefect"], open_timeout=30) as ws:
        ws.send(json.dumps({"type": "auth", "token": secret}))
        assert json.loads(ws.recv(timeout=30)) == {"type": "auth_success"}

    # `featcal server status|start` say it; the recorded server's secret is found for its URL, not for others.
    assert main(["server", "status", "--home", str(home)]) == 0
    assert f"basic authentication, secret in {secret_file}" in capsys.readouterr().out
    assert main(["server", "start", "--home", str(home), "--host", "0.0.0.0", "--port", "0"]) == 0
    out = capsys.readouterr().out
    assert "already running" in out and "PREFECT_API_AUTH_STRING" in out and secret not in out
    assert server.auth_string_for(f"http://127.0.0.1:{auth_server.port}/api", home) == secret
    assert server.auth_string_for(auth_server.api_url, home) == secret
    assert server.auth_string_for(f"http://127.0.0.1:{auth_server.port + 1}/api", home) is None


def test_run_with_the_secret_completes_and_writes_no_secret(auth_server, tiny_example, s3_options, s3_bucket,
                                                            tmp_path):
    """`featcal run` on another shell finds the server and its secret under FEATCAL_HOME; the storage secret
    planted through --set is nowhere in clear: run directory, terminal, server log, API."""
    planted = _planted()
    run_dir = tmp_path / "run"
    code, out = _featcal("run", str(tiny_example / "bert" / "example.yaml"), "--run-dir", str(run_dir),
                         *_store_overrides(s3_bucket, {**s3_options, "secret": planted}), env=_env(auth_server))
    assert code == 0, out
    assert "reporting to the featcal server" in out
    flow_run_id = _flow_run_id(out)
    flow_run = httpx.get(f"{_base(auth_server)}/api/flow_runs/{flow_run_id}", auth=_basic(auth_server), timeout=30)
    assert flow_run.json()["state"]["type"] == "COMPLETED"

    assert planted not in out
    assert _files_containing(run_dir, planted) == []
    run_yaml = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert featcal_secrets.is_placeholder(run_yaml["runtime"]["storage_options"]["secret"])
    assert run_yaml["runtime"]["storage_options"]["endpoint_url"] == s3_options["endpoint_url"]  # not a secret
    overrides = flow_run.json()["parameters"]["overrides"]
    assert any("<redacted:" in o for o in overrides) and any("endpoint_url" in o for o in overrides)

    texts = wait_for("the run's task runs in the API", lambda: (
        t if json.loads((t := _api_texts(auth_server, flow_run_id))["task runs"]).__len__() >= STAGES else None),
        timeout=60)
    assert json.loads(texts["logs"]), "the run sent no logs: the grep below would prove nothing"
    assert {name: planted in text for name, text in texts.items()} == dict.fromkeys(texts, False)
    server_log = (Path(auth_server.home) / server.LOG_FILE).read_text(errors="replace")
    assert planted not in server_log
    auth_secret = server.auth_secret(Path(auth_server.home))  # the server's own secret is not written around either
    assert auth_secret not in out and auth_secret not in server_log and _files_containing(run_dir, auth_secret) == []


# ---- secrets in config, records and logs (no server needed) -----------------------------------------------------
def test_secrets_change_the_fingerprint_but_only_their_hash_is_kept(tiny_example, tmp_path, monkeypatch, caplog):
    from tasks.context import RunContext

    config = tiny_example / "bert" / "example.yaml"
    a, b = _planted(), _planted()
    opts = lambda s: [f'runtime.storage_options={{"endpoint_url": "http://x", "secret": "{s}", "key": "id"}}']  # noqa: E731
    cfg_a, cfg_b, plain = load_config(config, opts(a)), load_config(config, opts(b)), load_config(config)
    assert cfg_a.runtime.storage_options["secret"] == a  # the run itself uses the value
    assert cfg_a.fingerprint() != cfg_b.fingerprint()
    assert cfg_a.fingerprint() == load_config(config, opts(a)).fingerprint()
    assert a not in json.dumps(cfg_a.redacted()) and a not in cfg_a.fingerprint()
    assert plain.redacted() == plain.model_dump(mode="json", by_alias=True)  # no secret, nothing changes
    assert cfg_a.slice("featcal", "calibration") == plain.slice("featcal", "calibration")  # stage keys unchanged

    # A stage rebuilds the config from run.yaml and restores the value from memory; without it, one clear line.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.yaml").write_text(yaml.safe_dump(cfg_a.redacted(), sort_keys=False))
    assert a not in (run_dir / "run.yaml").read_text()
    assert RunContext(run_dir).cfg.runtime.storage_options["secret"] == a
    monkeypatch.setattr(featcal_secrets, "_known", {})
    with pytest.raises(featcal_secrets.SecretUnknown,
                       match=r"run.yaml: runtime.storage_options.secret, runtime.storage_options.key are redacted.*"
                             r"rerun `featcal run` with the config or --set that sets it.*AWS_SECRET_ACCESS_KEY"):
        RunContext(run_dir)
    monkeypatch.undo()

    # Logs: a known secret is replaced wherever a log line would carry it.
    import logging

    with caplog.at_level(logging.INFO, logger="featcal"):
        logging.getLogger("featcal").info("storage said: bad secret %s", a)
    assert a not in caplog.text and "<redacted:" in caplog.text

    # Deployments store overrides redacted and hand the values to their runs through the environment only.
    params = deploy.deployment_parameters(str(config), str(run_dir), opts(a), "local", None, None, 1, False)
    assert a not in json.dumps(params) and "<redacted:" in params["overrides"][0]
    monkeypatch.delenv(featcal_secrets.ENV_VAR, raising=False)
    deploy.export_override_secrets(opts(a))
    assert a in os.environ[featcal_secrets.ENV_VAR]
    # ...and an error about a bad --set does not echo its secret.
    with pytest.raises(ValueError) as bad:
        load_config(config, [f'runtime.storage_options={{"secret": "{a}", "x": [}}'])
    assert a not in str(bad.value)


def test_what_looks_like_a_credential():
    secret = featcal_secrets.looks_secret
    assert all(map(secret, ["key", "secret", "token", "password", "auth", "aws_secret_access_key", "session_token",
                            "sessionToken", "client_secret", "account_key", "sas_token", "Authorization",
                            "connection_string", "api_key", "credentials"]))
    assert not any(map(secret, ["pooled_token_weight", "endpoint_url", "client_kwargs", "region_name", "anon",
                                "keep_activations", "key_column", "tokenizer", "max_new_tokens", "num_keys"]))
    # no field of the config itself looks like one (calibration.views.token_drop once did, and was redacted)
    from pydantic import BaseModel

    from featcal.config import RunConfig

    def fields(model: type[BaseModel]) -> list[str]:
        out = []
        for name, info in model.model_fields.items():
            out.append(info.alias or name)
            nested = [t for t in (info.annotation, *getattr(info.annotation, "__args__", ()))
                      if isinstance(t, type) and issubclass(t, BaseModel)]
            out += [f for t in nested for f in fields(t)]
        return out

    assert [f for f in fields(RunConfig) if secret(f)] == []
    # task names are names, not settings: a task called "token" keeps its expert path, label words, prompts
    named = {"experts": {"token": "/m/e"}, "evaluation": {"label_words": {"token": ["no", "yes"]}},
             "zero_shot": {"class_names": {"token": ["a"]}, "task_templates": {"token": ["{}"]}}}
    assert featcal_secrets.redact(named) == named


# ---- Dask over TLS ----------------------------------------------------------------------------------------------
def _make_tls(where: Path) -> dict[str, str]:
    """A CA and one certificate it signs (for the scheduler, the workers and the client), all PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("featcal test CA")).issuer_name(name("featcal test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("featcal dask")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"ca": where / "ca.pem", "cert": where / "dask.pem", "key": where / "dask-key.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    files["key"].chmod(0o600)
    return {k: str(v) for k, v in files.items()}


@pytest.fixture
def tls_cluster(tmp_path) -> Iterator[tuple[str, dict[str, str], Path]]:
    """`dask scheduler` and `dask worker` started the way docs/security.md shows, with certificates of our CA."""
    tls = _make_tls(tmp_path)
    flags = ["--tls-ca-file", tls["ca"], "--tls-cert", tls["cert"], "--tls-key", tls["key"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") or k == "PREFECT_HOME"}  # the session's
    env.update(OMP_NUM_THREADS="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1")
    logs = tmp_path / "dask-logs"
    with dask_processes("tls", env, logs, flags) as address:
        yield address, tls, logs


def _refused_without_a_certificate(address: str, ca_file: str) -> bool:
    """Whether the scheduler ends a TLS connection from a client that trusts the CA but shows no certificate."""
    import ssl

    host, port = address.removeprefix("tls://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca_file)
    context.check_hostname = False
    try:
        with socket.create_connection((host, int(port)), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=host) as conn:
            conn.sendall(b"\0" * 8)
            return conn.recv(1) == b""  # TLS 1.3: the refusal arrives after the handshake
    except (ssl.SSLError, ConnectionError):
        return True


def test_dask_over_tls_with_a_ca_made_here(auth_server, tiny_example, tls_cluster, s3_options, s3_bucket, tmp_path):
    """Scheduler and workers with certificates of our CA; `featcal run --address tls://… --tls-*` runs every
    stage on them, reporting to the authenticated server; a client without a certificate is refused; the
    storage secret reaches the workers in memory only."""
    address, tls, logs = tls_cluster
    assert _refused_without_a_certificate(address, tls["ca"])  # trusting the CA is not enough: it wants ours
    with pytest.raises(DaskUnavailable, match="needs --tls-ca-file and --tls-cert"):
        check_tls(address)
    with pytest.raises(DaskUnavailable, match="for an existing cluster reached with --address tls://"):
        check_tls("tcp://127.0.0.1:1", tls["ca"], tls["cert"], tls["key"])

    planted = _planted()
    run_dir = tmp_path / "run"
    code, out = _featcal("run", str(tiny_example / "bert" / "example.yaml"), "--run-dir", str(run_dir),
                         "--runner", "dask", "--address", address, "--tls-ca-file", tls["ca"],
                         "--tls-cert", tls["cert"], "--tls-key", tls["key"],
                         *_store_overrides(s3_bucket, {**s3_options, "secret": planted}),
                         env=_env(auth_server))
    assert code == 0, out + (logs / "workers.log").read_text()[-3000:]
    flow_run_id = _flow_run_id(out)
    events = RunDir(run_dir).events()
    started = {e["pid"] for e in events if e["event"] == "start"}
    assert len(started) == 2 and len([e for e in events if e["event"] == "start"]) == STAGES  # both workers ran stages

    def task_runs_done():  # the workers report their task runs to the authenticated server (settings travel along)
        runs = httpx.post(f"{_base(auth_server)}/api/task_runs/filter", auth=_basic(auth_server), timeout=30,
                          json={"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200}).json()
        done = [r for r in runs if r["state"] and r["state"]["type"] == "COMPLETED"]
        return done if len(done) >= STAGES else None

    wait_for("the workers' task runs in the API", task_runs_done, timeout=60)
    assert planted not in out and _files_containing(run_dir, planted) == []
    assert planted not in (logs / "workers.log").read_text() + (logs / "scheduler.log").read_text()
    texts = _api_texts(auth_server, flow_run_id)
    assert {name: planted in text for name, text in texts.items()} == dict.fromkeys(texts, False)
