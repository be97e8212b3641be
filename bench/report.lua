-- report.lua - shared by the post_*.lua wrk scripts (bench/run.sh).
--
-- bench_setup(default_path, body_file, content_type) sets the request every
-- connection sends: POST $BENCH_PATH (default default_path) with the bytes of
-- $BENCH_BODY_DIR/$BENCH_BODY (default body_file; the directory defaults to
-- bench/out/, next to this file) as body.
-- done() prints one line "BENCH_JSON {...}" with the request count, errors
-- and latency percentiles in milliseconds, which run.sh parses.

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"

function bench_setup(default_path, body_file, content_type, accept)
   local dir = os.getenv("BENCH_BODY_DIR") or (here .. "out")
   local path = dir .. "/" .. (os.getenv("BENCH_BODY") or body_file)
   local f = assert(io.open(path, "rb"), "cannot open " .. path .. " (run bench/run.sh)")
   local body = f:read("*a")
   f:close()
   wrk.method = "POST"
   wrk.path = os.getenv("BENCH_PATH") or default_path
   wrk.body = body
   wrk.headers["Content-Type"] = content_type
   if accept then wrk.headers["Accept"] = accept end
end

function done(summary, latency, requests)
   local e = summary.errors
   local secs = summary.duration / 1e6
   local ms = function(us) return us / 1000.0 end
   io.write(string.format(
      'BENCH_JSON {"requests":%d,"duration_s":%.3f,"req_per_s":%.1f,"bytes":%d,' ..
      '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
      '"latency_ms":{"mean":%.3f,"stdev":%.3f,"max":%.3f,"p50":%.3f,"p90":%.3f,"p99":%.3f,"p999":%.3f}}\n',
      summary.requests, secs, summary.requests / secs, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      ms(latency.mean), ms(latency.stdev), ms(latency.max),
      ms(latency:percentile(50)), ms(latency:percentile(90)),
      ms(latency:percentile(99)), ms(latency:percentile(99.9))))
end
