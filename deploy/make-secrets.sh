#!/bin/sh
# Make the secrets the compose file and the Kubernetes manifests mount: a private CA, one server
# certificate for every service name callers dial, one client certificate (mutual TLS) and a random
# bearer token. Needs only `openssl`. Nothing it writes belongs in git (the secrets folders ignore it).
#
#   deploy/make-secrets.sh deploy/compose/secrets     # docker compose (compose.yaml mounts these)
#   deploy/make-secrets.sh deploy/k8s/secrets         # then: kubectl apply -k deploy/k8s/secrets
#   deploy/make-secrets.sh [--days N] [--generators N] [--force] OUT_DIR [NAME ...]
#
# OUT_DIR gets:
#   ca.crt               the CA every caller trusts (services' certificates, and clients' for mTLS)
#   ca.key               the CA's key: mounted nowhere; keep it to issue more certificates, or delete it
#   tls.crt, tls.key     the services' certificate: subject alternative names below, plus NAMEs
#   client.crt, client.key  the callers' certificate (coordinator, learner, health probes, operators)
#   token                the bearer token (64 hex characters) every call but health checks carries
#
# Server names: the compose service names (reward, env, gateway, generator, learner, coordinator),
# the Kubernetes Services (the same but generator), each generator replica's stable name
# generator-<i>.generator-headless, i < --generators, and loopback (localhost, 127.0.0.1, ::1:
# health probes and ports published on the host). gRPC treats a wildcard with one label after the
# `*` (*.generator-headless) as invalid ("Invalid toplevel subdomain"), hence the generator names
# one by one. Other names (a namespace-qualified name, an ingress host, an IP) go after OUT_DIR.
#
# It refuses to overwrite an existing set (running services would distrust each other half-way
# through a rotation): --force replaces every file. Services read their files once at start; restart
# them after a rotation (docker compose up -d --force-recreate; kubectl rollout restart).
set -eu

days=825           # what browsers accept for leaf certificates; the CA lives ten years
generators=8
force=0
usage() {
    echo "usage: make-secrets.sh [--days N] [--generators N] [--force] OUT_DIR [NAME ...]" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in
        --days) [ $# -ge 2 ] || usage; days=$2; shift 2 ;;
        --generators) [ $# -ge 2 ] || usage; generators=$2; shift 2 ;;
        --force) force=1; shift ;;
        -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; break ;;
        -*) echo "make-secrets.sh: unknown option $1" >&2; usage ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || usage
out=$1
shift
case "$days$generators" in *[!0-9]*|'') echo "make-secrets.sh: --days and --generators take whole numbers" >&2; exit 2 ;; esac
command -v openssl >/dev/null 2>&1 || { echo "make-secrets.sh: openssl not found (apt-get install openssl)" >&2; exit 1; }

files="ca.crt ca.key tls.crt tls.key client.crt client.key token"
mkdir -p "$out"
if [ "$force" = 0 ]; then
    for f in $files; do
        if [ -e "$out/$f" ]; then
            echo "make-secrets.sh: $out/$f exists; --force replaces the whole set (then restart the services)" >&2
            exit 1
        fi
    done
fi
# The folder keeps other users of this machine out (0700). The files inside are readable by anyone
# who gets that far, because the containers run as uid 10001, which owns nothing here: compose
# bind-mounts these very files, ownership and mode included.
chmod 700 "$out"
umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

sans="DNS:reward,DNS:env,DNS:gateway,DNS:generator,DNS:learner,DNS:coordinator,DNS:localhost,IP:127.0.0.1,IP:::1"
i=0
while [ "$i" -lt "$generators" ]; do
    sans="$sans,DNS:generator-$i.generator-headless"
    i=$((i + 1))
done
for name in "$@"; do
    case "$name" in
        *:*) sans="$sans,IP:$name" ;;          # IPv6
        *[!0-9.]*) sans="$sans,DNS:$name" ;;
        *) sans="$sans,IP:$name" ;;            # IPv4
    esac
done

# One config for all three: a [req] section so `openssl req` asks nothing, and the extensions of
# each kind of certificate (key usage for ECDSA keys is digitalSignature only).
cat >"$work/openssl.cnf" <<EOF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = relayrl
[ca]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = $sans
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
EOF

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
serial() { echo "0x$(openssl rand -hex 16)"; }
# issue NAME CN EXTENSIONS: a key and a certificate signed by the CA.
issue() {
    key "$work/$1.key"
    openssl req -new -config "$work/openssl.cnf" -key "$work/$1.key" -subj "/CN=$2" -out "$work/$1.csr"
    openssl x509 -req -in "$work/$1.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" -set_serial "$(serial)" \
        -days "$days" -sha256 -extfile "$work/openssl.cnf" -extensions "$3" -out "$work/$1.crt" 2>/dev/null
}

key "$work/ca.key"
openssl req -x509 -new -config "$work/openssl.cnf" -key "$work/ca.key" -subj "/CN=relayrl CA" \
    -set_serial "$(serial)" -days 3650 -sha256 -extensions ca -out "$work/ca.crt"
issue tls "relayrl services" server
issue client "relayrl client" client
openssl rand -hex 32 >"$work/token"

# Written aside, then moved in: a failure above leaves the old set (or nothing) in place.
for f in $files; do
    mv -f "$work/$f" "$out/$f"
done
chmod 644 "$out/ca.crt" "$out/tls.crt" "$out/tls.key" "$out/client.crt" "$out/client.key" "$out/token"
chmod 600 "$out/ca.key"
echo "wrote $out: $files"
echo "server names: $sans"
