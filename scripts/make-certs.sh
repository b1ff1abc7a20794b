#!/usr/bin/env bash
# Make a local CA and certificates for trying TLS / mutual TLS (`make certs`).
#   scripts/make-certs.sh OUT_DIR [WORKER_ID ...]
# Writes OUT_DIR/ca.{pem,key}, OUT_DIR/chief.{pem,key} (SAN: chief, localhost, 127.0.0.1) and
# one OUT_DIR/<id>.{pem,key} per worker id, whose CN and SAN are the worker id: the chief lets a
# worker join only under the id its certificate names. For trying things out, not production.
set -euo pipefail
out=${1:?usage: make-certs.sh OUT_DIR [WORKER_ID ...]}
shift
ids=("$@")
[ ${#ids[@]} -gt 0 ] || ids=(worker-0 worker-1 worker-2)
mkdir -p "$out"
cd "$out"
openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=collective test CA" \
  -keyout ca.key -out ca.pem 2>/dev/null
issue() {  # name, subject CN, subjectAltName
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
issue chief chief "DNS:chief,DNS:localhost,IP:127.0.0.1"
for id in "${ids[@]}"; do
  issue "$id" "$id" "DNS:$id"
done
chmod 600 ./*.key
echo "certificates in $out: ca.pem, chief.pem/key, ${ids[*]/%/.pem/key}"
