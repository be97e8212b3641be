#!/bin/sh
# with_s3.sh CMD [ARGS...] - run CMD against a real S3 server: npm's s3rver
# behind the SigV4-checking proxy of tests/e2e/s3.py, on free loopback ports
# with a temporary directory, and a bucket created. CMD sees
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (a fresh one each run), AWS_REGION,
# AWS_ENDPOINT_URL_S3 (the proxy), S3_URL (s3://BUCKET), S3_BUCKET,
# S3RVER_PID (to kill -STOP it) and S3_HARNESS_CONTROL (the proxy's fault
# knob). Both servers are stopped afterwards; the exit status is CMD's.
# Needs `make s3rver` (build/tools/s3rver) and python3-boto3.
exec /usr/bin/python3 "$(dirname "$0")/e2e/s3.py" run -- "$@"
