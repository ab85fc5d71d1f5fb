#!/usr/bin/env bash
# Test certificates for the TLS tests (Rust and Python): a CA, a server certificate for
# localhost / 127.0.0.1 signed by it, a client certificate signed by it, and a second CA that
# signed nothing we use (the "wrong CA"). Usage: make_certs.sh DIR. Needs openssl.
set -euo pipefail
d=$1
mkdir -p "$d"
cd "$d"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
ca() {
    key "$1.key"
    openssl req -x509 -new -key "$1.key" -days 2 -subj "/CN=kvoffload test $1" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign" \
        -out "$1.crt" 2>/dev/null
}
leaf() { # name, extendedKeyUsage, subjectAltName
    key "$1.key"
    openssl req -new -key "$1.key" -subj "/CN=kvoffload test $1" -out "$1.csr" 2>/dev/null
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=%s\n%s\n' \
        "$2" "$3" >"$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
        -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    rm "$1.csr" "$1.ext"
}
ca ca
ca other-ca
leaf server serverAuth "subjectAltName=DNS:localhost,IP:127.0.0.1"
leaf client clientAuth ""
