#!/usr/bin/env bash
# Makes a throw-away CA, node and client certificates signed by it, an intruder certificate
# signed by another CA, and a passphrase-protected client key, in directory $1.
set -euo pipefail
cd "$1"
q() { "$@" 2>/dev/null; }
q openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj "/CN=troupe test CA"
q openssl req -x509 -newkey rsa:2048 -nodes -keyout rogue.key -out rogue.pem -days 2 -subj "/CN=rogue CA"
for who in node client; do
  q openssl req -newkey rsa:2048 -nodes -keyout $who.key -out $who.csr -subj "/CN=$who"
  q openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $who.pem -days 2
done
q openssl req -newkey rsa:2048 -nodes -keyout intruder.key -out intruder.csr -subj "/CN=intruder"
q openssl x509 -req -in intruder.csr -CA rogue.pem -CAkey rogue.key -CAcreateserial -out intruder.pem -days 2
q openssl pkey -in client.key -aes256 -passout pass:secret -out client-encrypted.key
