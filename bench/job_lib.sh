# job_lib.sh - sourced by bench/jobs_ab.sh and bench/cpu_split.sh.
# bench_job BASE INPUT_JSON [POLL_S]: POST a batch-64, NPY-output job of model
# "fashion" to the server at BASE, poll it every POLL_S (0.5) seconds for at
# most 120 s until it succeeded, and print the rows_per_s it reports.
bench_job() {
    local base=$1 input=$2 poll=${3:-0.5} id st
    id=$(curl -sf "$base/jobs" -d "{\"model\":\"fashion\",\"batch_size\":64,\"input\":$input,\"output\":{\"format\":\"npy\"}}" |
        sed -n 's/.*"id": *"\([^"]*\)".*/\1/p')
    for _ in $(seq "$(awk -v p="$poll" 'BEGIN { print int(120 / p) }')"); do
        sleep "$poll"
        st=$(curl -sf "$base/jobs/$id")
        case $st in *'"status": "succeeded"'* | *'"status":"succeeded"'*) break ;; esac
    done
    sed -n 's/.*"rows_per_s": *\([0-9]*\).*/\1/p' <<<"$st"
}
