"""The egress proxy container's entry point.

Its first line on stdin is the bootstrap (JSON): the key grants are signed with, the deployment's
CA (key and certificate, PEM; they live in this container's tmpfs only, never in an image, a
volume or the environment) and the extra upstream CAs. Without a CA one is made here, and sent to
the server (``{"ev": "ca", ...}``), which keeps it for the next start. Everything after that line
is the addon's control channel. Access records go to the container's stdout (fd 3 for the addon),
mitmproxy's own log to stderr.

The addon's bridge (``egress_bridge``, in mitmdump's process) carries the sandboxes' unix socket
(on the volume they mount read-only) to mitmproxy's loopback port: mitmproxy listens on TCP only.
"""

import datetime
import json
import os
import sys

RUN = "/run/egress"  # tmpfs, mode 0700, this container's user only
SOCK_DIR = "/sock"  # the volume sandboxes mount read-only
SYSTEM_CAS = "/etc/ssl/certs/ca-certificates.crt"
PORT = 8080
BOOT_MAX = 1 << 20


def read_line(fd: int = 0) -> bytes:
    """The bootstrap, byte by byte: what follows its line belongs to mitmdump's addon."""
    out = bytearray()
    while len(out) < BOOT_MAX:
        byte = os.read(fd, 1)
        if not byte or byte == b"\n":
            break
        out += byte
    return bytes(out)


def write(path: str, text: str, mode: int) -> None:
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(path + ".tmp", path)


def make_ca() -> tuple[str, str]:
    """A CA for this deployment: EC P-256, ten years, and the key usage strict clients require."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mcp-code-exec egress CA")])
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    return key_pem, cert.public_bytes(serialization.Encoding.PEM).decode()


def main() -> None:
    boot = json.loads(read_line())
    os.makedirs(f"{RUN}/conf", mode=0o700, exist_ok=True)
    key_pem, cert_pem = boot.get("ca_key", ""), boot.get("ca_cert", "")
    if not key_pem or not cert_pem:
        key_pem, cert_pem = make_ca()
        sys.stdout.write(json.dumps({"ev": "ca", "key": key_pem, "cert": cert_pem}) + "\n")
        sys.stdout.flush()
    write(f"{RUN}/conf/mitmproxy-ca.pem", key_pem + cert_pem, 0o600)
    write(f"{RUN}/grant.key", str(boot["grant_key"]), 0o600)
    with open(SYSTEM_CAS) as handle:
        system = handle.read()
    upstream = str(boot.get("upstream_ca", ""))
    write(f"{RUN}/upstream-bundle.pem", system + upstream, 0o600)
    # What sandboxes trust: the public CAs and the internal ones (tunnelled hosts end their TLS in
    # the sandbox), and the deployment CA (hosts with a secret end theirs here).
    write(f"{SOCK_DIR}/ca-bundle.pem", system + upstream + cert_pem, 0o644)
    os.environ["EGRESS_SOCKET_GID"] = str(int(boot["socket_gid"]))  # the relays' group (see egress_bridge)
    os.environ["EGRESS_MAX_CONNECTIONS"] = str(int(boot.get("max_connections", 4096)))
    os.environ["EGRESS_PORT"] = str(PORT)
    os.environ["EGRESS_HEAD_S"] = str(float(boot.get("head_s", 60.0)))
    os.environ["EGRESS_HEADS_BUDGET"] = str(int(boot.get("heads_budget", 1 << 20)))
    os.dup2(1, 3)  # the addon's records and replies: the container's stdout
    os.dup2(2, 1)  # mitmproxy's own output: stderr
    os.set_inheritable(3, True)
    options = {
        "listen_host": "127.0.0.1",
        "listen_port": str(PORT),
        "confdir": f"{RUN}/conf",
        "ssl_verify_upstream_trusted_ca": f"{RUN}/upstream-bundle.pem",
        "upstream_cert": "false",  # never connect upstream to look at a certificate (the SNI would go there)
        "show_ignored_hosts": "true",  # tunnels become TCP flows, whose hooks count their bytes
        "allow_hosts": "(?!)",  # replaced by the hosts with a secret; never empty (empty intercepts all)
        "connection_strategy": "eager",
        "stream_large_bodies": "64k",
        "http3": "false",
        # An upgraded connection (a WebSocket too) becomes a TCP flow, whose bytes the addon counts
        # and drops: mitmproxy's WebSocket layer would buffer each message whole and keep every one
        # for the connection's life (one sandbox could fill the proxy's memory), past every budget.
        "websocket": "false",
        "termlog_verbosity": str(boot.get("log_level", "warn")),
        "flow_detail": "0",
    }
    args = ["mitmdump", "--quiet"] if boot.get("log_level", "warn") in ("warn", "error") else ["mitmdump"]
    for name, value in options.items():
        args += ["--set", f"{name}={value}"]
    args += ["-s", "/opt/egress/egress_addon.py"]
    os.execvp(args[0], args)  # noqa: S606 - mitmdump with arguments of our own


if __name__ == "__main__":
    main()
