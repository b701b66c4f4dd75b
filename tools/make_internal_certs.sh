#!/usr/bin/env bash
# Makes the credentials of a loopback cluster's internal gRPC calls (once; existing files are
# kept): a local CA, one certificate + key signed by it for every process (SAN 127.0.0.1, ::1,
# localhost, and the name "dgserve-internal"), and a random shared token.
#
#   tools/make_internal_certs.sh [DIR]     (default: run/internal-certs, git-ignored)
#
# Writes DIR/ca.crt, DIR/ca.key, DIR/tls.crt, DIR/tls.key (cert-manager's Secret layout) and
# DIR/token. Pass --force as the first argument to make new ones (e.g. to test a reload).
# Needs openssl.
set -euo pipefail
FORCE=0
if [ "${1:-}" = "--force" ]; then FORCE=1; shift; fi
DIR=${1:-run/internal-certs}
mkdir -p "$DIR"
chmod 700 "$DIR"
if [ $FORCE -eq 0 ] && [ -s "$DIR/tls.crt" ] && [ -s "$DIR/tls.key" ] && [ -s "$DIR/ca.crt" ] &&
   [ -s "$DIR/token" ]; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ $FORCE -eq 1 ] || [ ! -s "$DIR/ca.crt" ] || [ ! -s "$DIR/ca.key" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/CN=dgserve local internal CA" -keyout "$tmp/ca.key" -out "$tmp/ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
else
  cp "$DIR/ca.crt" "$DIR/ca.key" "$tmp/"
fi
cat > "$tmp/ext.cnf" <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost,DNS:dgserve-internal
EOF
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=dgserve-internal" \
  -keyout "$tmp/tls.key" -out "$tmp/tls.csr" 2>/dev/null
openssl x509 -req -in "$tmp/tls.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -CAcreateserial \
  -days 825 -extfile "$tmp/ext.cnf" -out "$tmp/tls.crt" 2>/dev/null
if [ $FORCE -eq 1 ] || [ ! -s "$DIR/token" ]; then
  openssl rand -hex 32 > "$tmp/token"
else
  cp "$DIR/token" "$tmp/token"
fi
chmod 600 "$tmp/ca.key" "$tmp/tls.key" "$tmp/token"
# Keys before certificates: a reader that sees the new certificate also finds its key.
for f in ca.key tls.key ca.crt tls.crt token; do mv -f "$tmp/$f" "$DIR/$f.new"; done
for f in ca.key tls.key ca.crt tls.crt token; do mv -f "$DIR/$f.new" "$DIR/$f"; done
echo "make_internal_certs.sh: credentials in $DIR"
