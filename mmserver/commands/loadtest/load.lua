-- The benchmark's wrk script: picks the model of every request by a traffic pattern, counts
-- answers that are not 2xx by status, optionally paces requests at a fixed rate (open loop), and
-- prints one JSON line (prefixed "BENCH_JSON ") when the run is done.
--
-- Parameters come from the environment (wrk passes no options to a script's setup):
--   BENCH_PATTERN   uniform | hot | zipf | single | cycle
--   BENCH_MODELS    models sklearn-0 .. sklearn-(N-1) for uniform, hot, zipf and cycle
--                   (default 1000)
--   BENCH_MODEL     the model of the single pattern
--   BENCH_HOT       share of the requests going to sklearn-0 in the hot pattern (default 0.9)
--   BENCH_ZIPF_S    Zipf exponent; rank k (sklearn-(k-1)) has weight 1 / k^s (default 1.1)
--   BENCH_API       djl: POST /predictions/NAME; sagemaker: POST /invocations with the
--                   X-Amzn-SageMaker-Target-Model header naming NAME.tar.gz; v2 and
--                   mlserver: POST /v2/models/NAME/infer (Open Inference Protocol) (default djl)
--   BENCH_BODY      request body (default [[0.5]]; for v2 and mlserver, a V2 inference
--                   request, which benchlib/wrk.py makes of the rows)
--   BENCH_BODY_FILE a file holding the body instead (the djl API; any size)
--   BENCH_CONTENT_TYPE  the djl API's Content-Type (default application/json)
--   BENCH_THREADS   wrk's -t, used to stagger the threads' schedules
--   BENCH_THREAD_RATE  requests/s offered by each wrk thread; unset or 0 = closed loop
--   BENCH_SEED      random seed (default 1)
--   BENCH_START     the cycle pattern's first model: its requests go to sklearn-START,
--                   sklearn-(START+1), ... (modulo BENCH_MODELS), the threads interleaved
--
-- Open loop: wrk's delay() is asked before every request a connection sends. Each thread keeps a
-- schedule of send slots spaced 1/rate apart and hands the next slot to whichever of its
-- connections asks; delay() returns the time until that slot. A connection that asks after its
-- slot has passed sends at once, late: the thread then had every connection busy. wrk measures a
-- request's latency from when it is written, so a late send hides its lateness (coordinated
-- omission); the script counts sends more than 1 ms late so the harness can bound the latency as
-- seen from the schedule (see benchlib/wrk.py). wrk's timers have 1 ms resolution.

local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec_t;
int clock_gettime(int clk_id, bench_timespec_t *tp);
]]
local CLOCK_MONOTONIC = 1
local timespec = ffi.new("bench_timespec_t")

local function now_us()
    ffi.C.clock_gettime(CLOCK_MONOTONIC, timespec)
    return tonumber(timespec.tv_sec) * 1e6 + tonumber(timespec.tv_nsec) / 1e3
end

local function env_number(name, default)
    local value = os.getenv(name)
    if value == nil or value == "" then
        return default
    end
    return tonumber(value)
end

local pattern = os.getenv("BENCH_PATTERN") or "uniform"
local model_count = env_number("BENCH_MODELS", 1000)
local hot_share = env_number("BENCH_HOT", 0.9)
local zipf_s = env_number("BENCH_ZIPF_S", 1.1)
local api = os.getenv("BENCH_API") or "djl"
local body = os.getenv("BENCH_BODY") or "[[0.5]]"
-- A body too large for an environment variable (128 KiB at most) is read from a file.
local body_file = os.getenv("BENCH_BODY_FILE") or ""
if body_file ~= "" then
    local f = assert(io.open(body_file, "rb"))
    body = f:read("*a")
    f:close()
end
local content_type = os.getenv("BENCH_CONTENT_TYPE") or "application/json"
local thread_count = env_number("BENCH_THREADS", 1)
local thread_rate = env_number("BENCH_THREAD_RATE", 0)
local seed = env_number("BENCH_SEED", 1)
local start = env_number("BENCH_START", 0)

-- Every request's Authorization header (a tenant's bearer token), when set.
local authorization = os.getenv("BENCH_AUTHORIZATION") or ""

local function with_auth(headers)
    if authorization ~= "" then
        headers["Authorization"] = authorization
    end
    return headers
end

-- The V2 (Open Inference Protocol) form of the default body's one row.
-- Requests, built once: request() only picks one.
local function build_request(name)
    if api == "sagemaker" then
        return wrk.format("POST", "/invocations", with_auth({
            ["Content-Type"] = "application/json",
            ["X-Amzn-SageMaker-Target-Model"] = name .. ".tar.gz",
        }), body)
    end
    if api == "v2" or api == "mlserver" then
        return wrk.format("POST", "/v2/models/" .. name .. "/infer",
            with_auth({["Content-Type"] = "application/json"}), body)
    end
    return wrk.format("POST", "/predictions/" .. name,
        with_auth({["Content-Type"] = content_type}), body)
end

-- Built in init(): wrk sets the Host header only then.
local requests = {}

-- Zipf: the cumulative distribution over ranks, searched by bisection.
local zipf_cdf = {}
if pattern == "zipf" then
    local total = 0
    for k = 1, model_count do
        total = total + 1 / k ^ zipf_s
        zipf_cdf[k] = total
    end
    for k = 1, model_count do
        zipf_cdf[k] = zipf_cdf[k] / total
    end
    zipf_cdf[model_count] = 1
end

local function zipf_index()
    local u = math.random()
    local lo, hi = 1, model_count
    while lo < hi do
        local mid = math.floor((lo + hi) / 2)
        if zipf_cdf[mid] < u then
            lo = mid + 1
        else
            hi = mid
        end
    end
    return lo
end

local pick
if pattern == "single" then
    pick = function() return 1 end
elseif pattern == "hot" then
    pick = function()
        if math.random() < hot_share then
            return 1
        end
        return math.random(2, model_count)
    end
elseif pattern == "zipf" then
    pick = zipf_index
elseif pattern == "uniform" then
    pick = function() return math.random(1, model_count) end
elseif pattern == "cycle" then
    -- Each thread has a Lua state of its own: thread k takes START + k, then every
    -- BENCH_THREADS-th model after it, so no two requests in a cycle name the same model.
    local next_index = nil
    pick = function()
        if next_index == nil then
            next_index = start + (thread_id or 0)
        end
        local i = next_index % model_count + 1
        next_index = next_index + thread_count
        return i
    end
else
    error("BENCH_PATTERN must be uniform, hot, zipf, single or cycle, not " .. pattern)
end

-- Per-thread state; the main state collects it in done().
local threads = {}
local thread_index = 0
statuses = {}
sent = 0
late = 0
max_lag_us = 0

function setup(thread)
    thread:set("thread_id", thread_index)
    thread_index = thread_index + 1
    table.insert(threads, thread)
end

function init(args)
    math.randomseed(seed * 7919 + (thread_id or 0) * 104729)
    if pattern == "single" then
        requests[1] = build_request(os.getenv("BENCH_MODEL") or "sklearn-0")
    else
        for i = 1, model_count do
            requests[i] = build_request("sklearn-" .. (i - 1))
        end
    end
end

function request()
    return requests[pick()]
end

function response(status, headers, body)
    if status < 200 or status > 299 then
        local key = tostring(status)
        statuses[key] = (statuses[key] or 0) + 1
    end
end

if thread_rate > 0 then
    local interval_us = 1e6 / thread_rate
    local next_slot = nil

    function delay()
        local now = now_us()
        if next_slot == nil then
            next_slot = now + (thread_id or 0) * interval_us / thread_count
        end
        local slot = next_slot
        next_slot = slot + interval_us
        sent = sent + 1
        local wait = slot - now
        if wait >= 0 then
            return math.floor(wait / 1000)
        end
        if -wait > 1000 then
            late = late + 1
        end
        if -wait > max_lag_us then
            max_lag_us = -wait
        end
        return 0
    end
end

local function json_object(map)
    local parts = {}
    for key, value in pairs(map) do
        table.insert(parts, string.format("%q:%d", key, value))
    end
    return "{" .. table.concat(parts, ",") .. "}"
end

function done(summary, latency, _)
    local merged, total_sent, total_late, lag = {}, 0, 0, 0
    for _, thread in ipairs(threads) do
        for key, count in pairs(thread:get("statuses") or {}) do
            merged[key] = (merged[key] or 0) + count
        end
        total_sent = total_sent + (thread:get("sent") or 0)
        total_late = total_late + (thread:get("late") or 0)
        lag = math.max(lag, thread:get("max_lag_us") or 0)
    end
    local quantiles = {}
    for _, q in ipairs({50, 75, 90, 99, 99.9}) do
        table.insert(quantiles, string.format("\"%s\":%d", tostring(q), latency:percentile(q)))
    end
    -- The latency quantile that bounds the schedule-based p99 (benchlib/wrk.py explains it).
    local late_share = total_sent > 0 and total_late / total_sent or 0
    local bound_q = math.min(100, 99 + 100 * late_share)
    local bound = bound_q >= 100 and latency.max or latency:percentile(bound_q)
    local e = summary.errors
    io.write(string.format(
        "BENCH_JSON {\"duration_us\":%d,\"requests\":%d,\"bytes\":%d," ..
        "\"errors\":{\"connect\":%d,\"read\":%d,\"write\":%d,\"status\":%d,\"timeout\":%d}," ..
        "\"statuses\":%s,\"latency_us\":{\"min\":%d,\"max\":%d,\"mean\":%.1f,\"stdev\":%.1f," ..
        "\"quantiles\":{%s},\"p99_bound_quantile\":%.4f,\"p99_bound\":%d}," ..
        "\"open\":{\"thread_rate\":%.3f,\"sent\":%d,\"late\":%d,\"max_lag_us\":%d}}\n",
        summary.duration, summary.requests, summary.bytes,
        e.connect, e.read, e.write, e.status, e.timeout,
        json_object(merged), latency.min, latency.max, latency.mean, latency.stdev,
        table.concat(quantiles, ","), bound_q, bound,
        thread_rate, total_sent, total_late, lag))
end
