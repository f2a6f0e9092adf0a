-- ledger_v1.lua: the usage ledger's writes for one request, each atomic and applied once.
--
-- Version 1; it replaces usage_record_v2.lua, whose record write is its 'record' operation
-- (that version kept no reservations: every record was deduplicated by its id in a window set
-- only). Every key of one call carries the tenant's hash tag (one Redis Cluster slot):
--   R  <prefix>:reservations:{<tenant>}           hash: record id -> the reservation's JSON, open
--                                                 from the admission (token_bucket_take_v3.lua)
--                                                 until its usage lands, it is given back, or it
--                                                 is charged
--   D  <prefix>:reservations-due:{<tenant>}       zset: record id -> admission time (ms, Redis
--                                                 TIME), moved on by claims
--   C  <prefix>:reservations-charged:{<tenant>}   zset: record id -> when its reservation was
--                                                 charged (ms), kept ARGV's retention
--   S  <prefix>:usage-seen:{<tenant>}:<window>    set: record ids applied in a 10 s window of
--                                                 finish time
--   U  <prefix>:usage:{<tenant>}:<YYYY-MM-DD>     hash: <model>:requests, :prompt_tokens,
--                                                 :completion_tokens, :cached_tokens,
--                                                 :cost_nano_usd (only when not 0); the same
--                                                 fields of 'api_key <name>' for a record of a
--                                                 named key (a space: no model name has one)
--   B  token buckets, as token_bucket_take_v3.lua keeps them
--   Q  quota counters, as token_bucket_take_v3.lua keeps them (<prefix>:quota:{<tenant>}:...)
--   L  <prefix>:leases:{<tenant>}                 hash: lease id -> the admission lease's JSON
--                                                 ({"v":1,"model","requests","tokens"}), open from
--                                                 its grant (token_bucket_take_v3.lua records it
--                                                 like a reservation) until given back or reclaimed
--   LD <prefix>:leases-due:{<tenant>}             zset: lease id -> grant time (ms, Redis TIME)
--   LU <prefix>:leases-used:{<tenant>}            hash, per open lease:
--                                                 <lease id>:a, <lease id>:at, <lease id>:ap ->
--                                                 the requests the filter reported admitted from
--                                                 it (numbered 1 to a: the facts' lease_seq), the
--                                                 tokens they reserved and the prompt estimates
--                                                 within those ('lease_report');
--                                                 <lease id>:l, <lease id>:lt, <lease id>:lp ->
--                                                 the same three of the reported requests whose
--                                                 usage landed;
--                                                 <lease id>:#<seq> -> '<reserved>:<prompt>' of a
--                                                 request numbered past the report when its usage
--                                                 landed (moved into :l, :lt, :lp once a report
--                                                 covers it);
--                                                 <lease id>:r, <lease id>:t -> requests and
--                                                 reserved tokens of its requests without a
--                                                 number (an older filter) whose usage landed.
--                                                 A reclaimed lease keeps <lease id>:a, :at, :ap,
--                                                 :l, :lt, :lp and :m (its model) while it is in
--                                                 LR, and <lease id>:a while it is in LC
--   LR <prefix>:leases-reclaimed:{<tenant>}       zset: lease id -> when it was reclaimed (ms); a
--                                                 lease leaves it with its 'lease_charge'
--   LC <prefix>:leases-charged:{<tenant>}         zset: lease id -> when 'lease_charge' charged
--                                                 its reported requests whose usage never landed
--                                                 (ms), kept ARGV's retention
--
-- Quotas and cost (issue 14 item 5) are appended to 'record', 'charge' and 'release' after their
-- buckets (absent: none): for 'record' and 'charge' ARGV[9 + 3n] the record's cost in
-- nano-dollars (added to U's <model>:cost_nano_usd), then for all three ARGV[a] = q and per
-- counter j: period letter ('d' or 'm'), period label, model scope ('' for the tenant's quota),
-- expire_at (unix s), with KEYS after the buckets' the q counters. A counter moves by the tokens
-- used minus what the admission charged it (the reservation JSON's `quota`, charged in its
-- `qday` / `qmonth` period): a record without an open reservation adds its tokens, a give-back
-- takes the charge off. A reservation charged in another period than the counter's (the request
-- crossed midnight) leaves both alone: the admission's period keeps the reservation as used.
-- A counter of a model scope moves only for that model's requests.
--
-- Admission leases (issue 14 item 4): a leased request's 'record' may carry a lease section after
-- its quota section: ARGV[b] lease id, ARGV[b + 1] the tokens it reserved from the lease,
-- ARGV[b + 2] ms LU lives past this write, ARGV[b + 3] m, then per bucket capacity,
-- rate_per_minute, delta: what the request costs should its lease have been reclaimed (each
-- requests bucket -1, each tokens bucket minus the reservation), then ARGV[b + 4 + 3m] the
-- request's number among the lease's admissions ('' when the filter did not number it), and
-- ARGV[b + 5 + 3m] the prompt estimate within its reservation ('' or absent: 0); KEYS after the
-- quota counters: L, LU, LR, LC, then the m buckets (m may be 0 for a request the caller knows a
-- report numbers). Applied with the record only. A request numbered within the filter's last
-- report joins LU's landed counts (:l, :lt, :lp) while its lease is open or reclaimed (in LR),
-- so that the lease's charge leaves it out; once that charge has charged it (the lease in LC),
-- the record is not applied (returns 2, as a record of a charged reservation). While the lease is
-- open, a request numbered past the report is kept in LU under its number until a report covers
-- it, and one without a number joins LU's :r and :t. Once the lease was reclaimed (in LR or LC),
-- a request the reclaim did not count (numbered past the last report, or without a number: the
-- reclaim gave its reservation back) is charged it again by the m settlements (before the
-- record's own settlements, which a capacity would otherwise cut), so that it costs its usage,
-- as any leased request.
--
-- API keys: a 'record' or 'charge' of a request made with a named key ends with the key's
-- section: its lease section, or '' where the record has none (a charge never has one), then the
-- key's name; its usage is added under 'api_key <name>' too.
--
-- ARGV[1] names the operation:
--
-- 'record': a finished request's usage. KEYS: R, D, C, S, U, B1..Bn.
--   ARGV[2] record id, ARGV[3] unix time (s) at which S expires, ARGV[4] model, ARGV[5] prompt
--   tokens, ARGV[6] completion tokens, ARGV[7] cached tokens, ARGV[8] n, then per bucket:
--   capacity, rate_per_minute, delta (tokens given back; negative: charged more).
--   The request's open reservation, if any, is closed by it. A request whose reservation was
--   charged already is not applied (returns 2: the ledger billed its reservation). Otherwise the
--   id joins S, and a record whose id was there already is not applied (a retry after a write
--   that landed, or a second delivery, within the retention; returns 0). Applied: 1.
-- 'charge': an open reservation older than the longest stream lifetime, recorded as charged.
--   KEYS: R, D, C, U, B1..Bn. ARGV[2] record id, ARGV[3] C's retention (ms), ARGV[4..7] as for
--   'record', ARGV[8] n, per bucket: capacity, rate_per_minute, delta. Applied (1) only if the
--   reservation is still open; else 0 (its usage landed, it was given back, or another replica
--   charged it).
-- 'release': an admission given back before the request went upstream. KEYS: R, D, B1..Bn.
--   ARGV[2] record id, ARGV[3] n, per bucket: kind ('requests' or 'tokens'), capacity,
--   rate_per_minute. If the reservation is open it is closed and each requests bucket gets 1
--   back, each tokens bucket min(reserved, capacity) (`reserved` of the stored JSON): 1; else 0.
-- 'rereserve': the exact prompt count moves an open reservation. KEYS: R, B1..Bn (its tokens
--   buckets). ARGV[2] record id, ARGV[3] the new JSON, ARGV[4] n, per bucket: capacity,
--   rate_per_minute. Each bucket moves by min(before, capacity) - min(after, capacity): 1; not
--   open: nothing moves, 0.
-- 'lease_report': a filter reports the admissions of a lease it holds. KEYS: L, LU. ARGV[2] lease
--   id, ARGV[3] the requests admitted from it (numbered 1 to ARGV[3]), ARGV[4] the tokens they
--   reserved, ARGV[5] ms LU lives past this write, ARGV[6] the prompt estimates within ARGV[4]
--   (absent: 0). Only while the lease is open (else 0), and only a report past the recorded one:
--   it replaces LU's <id>:a, <id>:at and <id>:ap, and moves the <id>:#<seq> entries it covers
--   into the landed counts. 1.
-- 'lease_return': a filter gives the rest of an admission lease back. KEYS: L, LD, LU, B1..Bn.
--   ARGV[2] lease id, ARGV[3] n, per bucket: capacity, rate_per_minute, delta (what it gives
--   back). Applied (1) only if the lease is open; else 0 (reclaimed already: the reclaim gave back
--   what its requests had not used). The lease's LU entries go.
-- 'lease_reclaim': an open lease whose filter went away. KEYS: L, LD, LU, LR, B1..Bn. ARGV[2]
--   lease id, ARGV[3] how long LR and LU keep the lease for its 'lease_charge' (ms: the longest
--   stream lifetime, after which it is due, and room for the sweeps), ARGV[4] n, per bucket: kind ('requests'
--   or 'tokens'), capacity, rate_per_minute. The lease is closed and joins LR; its requests
--   counted are the reported ones, those numbered past the report whose usage landed, and those
--   without a number whose usage landed: each requests bucket gets back the lease's requests
--   less those, each tokens bucket its tokens less what those reserved (at most the capacity).
--   LU keeps the lease's report, landed counts and model for its 'lease_charge' (LR and LU live
--   at least ARGV[3] past the reclaim). Returns {1, requests back, tokens back}; {0, 0, 0} when it
--   was not open.
-- 'lease_charges_due': the leases reclaimed more than ARGV[2] ms ago (the longest stream
--   lifetime: their requests' usage can no longer arrive), at most ARGV[3]. KEYS: LR, LU.
--   Returns {id1, model1, id2, model2, ...}.
-- 'lease_charge': a reclaimed lease's reported requests whose usage never landed, charged their
--   reservations as usage, once. KEYS: LR, LU, LC, U (the usage hash of the charge's day),
--   Q1..Qq. ARGV[2] lease id, ARGV[3] LC's retention (ms), ARGV[4], ARGV[5] the model's prices in
--   nano-dollars per prompt and per completion token, ARGV[6] q and the quota counters as for
--   'record'. Only while the lease is in LR: it leaves LR for LC; U's <model> (LU's <id>:m) gains
--   the requests reported and not landed (a - l) as requests, their prompt estimates (ap - lp) as
--   prompt tokens, the rest of their reservations (at - lt) as completion tokens, and their cost;
--   each quota counter of the model gains their reservations (nothing for a lease without :m,
--   reclaimed by an older sidecar that kept no landed counts). LU keeps <id>:a while LC keeps the
--   lease. Returns {1, requests, tokens, prompt tokens} charged; {0, 0, 0, 0} when not in LR.
-- 'claim': the open reservations admitted more than ARGV[2] ms ago, at most ARGV[4] of them.
--   KEYS: R, D. Each one returned is due again ARGV[3] ms later (another replica's sweep takes it
--   should this one's charge not land). Returns {open reservations, id1, json1, id2, json2, ...}.
-- 'batch': several 'record', 'charge' and 'release' operations of one tenant (one cluster slot) in
--   one call, so their writes cost Redis one script call instead of one each. ARGV[2] m, then per
--   operation j: its key count kj, its argument count aj, and its aj arguments (ARGV of the
--   operation alone, its name first); KEYS: the operations' keys, k1 of the first, then k2 ...
--   Each runs as it would alone, in order; returns {r1, ..., rm}, each the operation's own reply,
--   or -1 where it raised an error (its writes up to the error stay, as for an operation alone:
--   the caller retries it as a write that may have landed). The call's deferred writes (see
--   'flush') are summed over its operations; an operation one of whose deferred keys failed to
--   be written is -1 too.

-- The current operation's keys and arguments (set by run).
local K, A = KEYS, ARGV

-- The largest count the ledger takes, 2^53 - 1 (meter.rs MAX_LEDGER_COUNT): Lua's numbers are
-- doubles, exact up to 2^53, and Redis integers are signed 64 bits.
local MAX_COUNT = 9007199254740991

-- A count (an argument, or a sum of counts) as an exact integer: an error for anything else, so
-- that the ledger refuses a number it cannot hold exactly (an upstream's 2^63 - 1, which a
-- double rounds and '%d' then writes as -2^63) rather than write a wrong one.
local function count(v)
  local n = tonumber(v)
  if n == nil or n ~= math.floor(n) or n > MAX_COUNT or n < -MAX_COUNT then
    error('ledger_v1.lua: not an exact count: ' .. tostring(v))
  end
  return n
end

-- Writes a call defers to its end (see 'flush'): the usage hash's and the lease counts'
-- HINCRBYs summed per field, the quota counters' INCRBYs summed, each key's expiry set once
-- (the last one asked), and each token bucket read once, settled in memory in the order asked,
-- and written once. Sums commute and a bucket's settlements keep their order, so the books end
-- where one call per write leaves them; a batch of a tenant's records then costs Redis about
-- three commands per record (its reservation, charged and idempotency lookups) instead of about
-- twenty.
--   P.keys[key] = { fields = {field -> sum} or nil, order = {fields in first-use order},
--                   incr = sum or nil, expire = {command, argument} or nil,
--                   bucket = {level, ts, capacity, rate, dirty} or nil,
--                   ops = {operation index -> true} (the writes that fail should this key's
--                   flush fail) }
--   P.order: keys in first-use order. OP: the current operation's index in its call.
local P = { keys = {}, order = {} }
local OP = 1
-- The call's one TIME (µs), read on first use.
local NOW = nil

local function now_us()
  if NOW == nil then
    local t = redis.call('TIME')
    NOW = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return NOW
end

-- The pending entry of `key`, the current operation counted as one of its writers.
local function pending(key)
  local e = P.keys[key]
  if e == nil then
    e = { ops = {} }
    P.keys[key] = e
    P.order[#P.order + 1] = key
  end
  e.ops[OP] = true
  return e
end

-- HINCRBY key field by, deferred.
local function hincrby(key, field, by)
  local e = pending(key)
  if e.fields == nil then e.fields, e.order = {}, {} end
  if e.fields[field] == nil then
    e.fields[field] = 0
    e.order[#e.order + 1] = field
  end
  e.fields[field] = count(e.fields[field] + count(by))
end

-- INCRBY key by, deferred.
local function incrby(key, by)
  local e = pending(key)
  e.incr = count((e.incr or 0) + count(by))
end

-- An expiry command (EXPIRE, EXPIREAT, PEXPIRE) of key, deferred: the last one asked is set.
local function expire(key, command, arg)
  pending(key).expire = { command, arg }
end

-- A count as Redis reads it (tostring would write 1e+15 for large ones); an error for anything
-- but an exact count.
local function int(n)
  return string.format('%d', count(n))
end

-- The text of an error raised in the script (redis.call raises a table with 'err').
local function error_message(err)
  if type(err) == 'table' and err.err then
    return err.err
  end
  return tostring(err)
end

-- Writes what the call deferred, key by key. A key whose writes raise an error marks its
-- writers failed in `out` (a batch's replies) and gives the first error back; its other keys
-- are written all the same.
local function flush(out)
  local first_err = nil
  for _, key in ipairs(P.order) do
    local e = P.keys[key]
    local ok, err = pcall(function()
      local b = e.bucket
      if b ~= nil and b.dirty then
        redis.call('HSET', key, 't', tostring(b.level), 'ts', tostring(b.ts))
        local missing = b.capacity - b.level
        local keep_ms = 60000
        if b.rate > 0 and missing > 0 then keep_ms = keep_ms + math.ceil(missing / b.rate / 1000) end
        redis.call('PEXPIRE', key, keep_ms)
      end
      if e.fields ~= nil then
        for _, field in ipairs(e.order) do
          redis.call('HINCRBY', key, field, int(e.fields[field]))
        end
      end
      if e.incr ~= nil then
        redis.call('INCRBY', key, int(e.incr))
      end
      if e.expire ~= nil then
        redis.call(e.expire[1], key, e.expire[2])
      end
    end)
    if not ok then
      if first_err == nil then first_err = error_message(err) end
      if out ~= nil then
        for j in pairs(e.ops) do out[j] = -1 end
      end
    end
  end
  return first_err
end

-- token_bucket_settle_v1.lua's settlement of one bucket, on its pending state (read once per
-- call, written by flush).
local function settle(key, capacity, rate_per_minute, delta, now)
  if delta == 0 then
    return
  end
  local rate = rate_per_minute / 60000000.0
  local e = pending(key)
  local b = e.bucket
  if b == nil then
    local state = redis.call('HMGET', key, 't', 'ts')
    b = { level = tonumber(state[1]), ts = tonumber(state[2]), dirty = false }
    e.bucket = b
  end
  local level
  if b.level == nil or b.ts == nil then
    -- A missing bucket reads as full: giving back to it changes nothing, and not creating it
    -- leaves a node that came back empty to token_bucket_reconcile_v1.lua.
    if delta > 0 then
      return
    end
    level = capacity
  else
    local elapsed = now - b.ts
    if elapsed < 0 then elapsed = 0 end
    level = math.min(capacity, b.level + elapsed * rate)
  end
  b.level = math.min(capacity, level + delta)
  b.ts, b.capacity, b.rate, b.dirty = now, capacity, rate, true
end

-- Buckets from K[first], settlements (capacity, rate, delta) from A[arg].
local function settle_all(first, arg, n, now)
  for i = 1, n do
    local a = arg + 3 * (i - 1)
    settle(K[first + i - 1], tonumber(A[a]), tonumber(A[a + 1]), count(A[a + 2]), now)
  end
end

-- The usage hash's increments of one request (or of a lease's charged requests).
local function usage_adds(prompt, completion, cached, cost, requests)
  local adds = {
    { ':requests', requests or 1 }, { ':prompt_tokens', prompt },
    { ':completion_tokens', completion }, { ':cached_tokens', cached },
  }
  if cost ~= nil and cost ~= '' and cost ~= '0' then adds[#adds + 1] = { ':cost_nano_usd', cost } end
  return adds
end

-- Raises an error, before anything is written, when an increment of the usage hash `key` is not
-- an exact count or would take its pending sum past one ([`count`]): a request whose numbers the
-- ledger cannot hold changes nothing.
local function check_usage(key, model, prompt, completion, cached, cost, requests)
  local e = P.keys[key]
  for _, add in ipairs(usage_adds(prompt, completion, cached, cost, requests)) do
    local before = 0
    if e ~= nil and e.fields ~= nil then before = e.fields[model .. add[1]] or 0 end
    count(before + count(add[2]))
  end
end

local function add_usage(key, model, prompt, completion, cached, cost, requests)
  check_usage(key, model, prompt, completion, cached, cost, requests)
  for _, add in ipairs(usage_adds(prompt, completion, cached, cost, requests)) do
    hincrby(key, model .. add[1], add[2])
  end
  expire(key, 'EXPIRE', 40 * 86400)
end

-- Moves the quota counters (K[first_key..]) described from A[a] on by the tokens `used`
-- minus what the reservation `json` (nil: none) charged them; `model` is the request's model
-- (nil: the reservation's).
local function adjust_quotas(first_key, a, model, used, json)
  local q = tonumber(A[a] or '0') or 0
  if q == 0 then
    return
  end
  local charged, qday, qmonth = 0, nil, nil
  if json then
    local ok, r = pcall(cjson.decode, json)
    if ok and type(r) == 'table' then
      charged = tonumber(r.quota) or 0
      qday, qmonth = r.qday, r.qmonth
      if model == nil then model = r.model end
    end
  end
  for j = 1, q do
    local b = a + 1 + 4 * (j - 1)
    local letter, label, scope = A[b], A[b + 1], A[b + 2]
    if scope == '' or scope == model then
      local delta = used
      if charged > 0 then
        local at = qmonth
        if letter == 'd' then at = qday end
        if at == label then delta = used - charged else delta = 0 end
      end
      if delta ~= 0 then
        local key = K[first_key + j - 1]
        incrby(key, delta)
        expire(key, 'EXPIREAT', A[b + 3])
      end
    end
  end
end

-- Remembers `id` in the sorted set `key` (score: now in ms) for `keep` ms, forgetting older ids.
local function remember(key, id, now, keep)
  local now_ms = math.floor(now / 1000)
  redis.call('ZADD', key, now_ms, id)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms - keep)
  redis.call('PEXPIRE', key, keep)
end

-- The `reserved` tokens of a reservation's JSON (0 if unreadable).
local function reserved_of(json)
  local ok, r = pcall(cjson.decode, json)
  if ok and type(r) == 'table' then
    return tonumber(r.reserved) or 0
  end
  return 0
end

-- Whether lease `id` is open in the hash `key`, asked once per call (a batch changes no lease).
local OPEN = {}
local function lease_open(key, id)
  local at = key .. ' ' .. id
  if OPEN[at] == nil then
    OPEN[at] = redis.call('HEXISTS', key, id) == 1
  end
  return OPEN[at]
end

-- The admissions of lease `id` the filter reported (LU = `key`'s <id>:a, 0 if none), asked once
-- per call (a batch holds no reports).
local REPORTED = {}
local function lease_reported(key, id)
  local at = key .. ' ' .. id
  if REPORTED[at] == nil then
    REPORTED[at] = tonumber(redis.call('HGET', key, id .. ':a')) or 0
  end
  return REPORTED[at]
end

-- An <id>:#<seq> entry's value: its reserved tokens and the prompt estimate within them
-- ('<reserved>:<prompt>', or '<reserved>' as an older sidecar wrote it).
local function reserved_prompt(value)
  local r, p = string.match(value or '', '^(%d+):(%d+)$')
  if r ~= nil then
    return tonumber(r), tonumber(p)
  end
  return tonumber(value) or 0, 0
end

-- LU (`key`)'s <id>:#<seq> entries of lease `id`: a list of {field, seq, tokens, prompt}.
local function numbered(key, id)
  local prefix = id .. ':#'
  local out = {}
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local field = all[i]
    if string.sub(field, 1, #prefix) == prefix then
      local tokens, prompt = reserved_prompt(all[i + 1])
      out[#out + 1] = { field, tonumber(string.sub(field, #prefix + 1)) or 0, tokens, prompt }
    end
  end
  return out
end

-- HDEL of `fields` from `key`, in chunks (Lua's unpack has a stack limit).
local function hdel_all(key, fields)
  for i = 1, #fields, 512 do
    redis.call('HDEL', key, unpack(fields, i, math.min(i + 511, #fields)))
  end
end

-- A record's lease section from K[k] and A[a] (see the header); nothing without one.
local function lease_use(k, a, now)
  local id = A[a]
  if id == nil or id == '' then
    return
  end
  local m = tonumber(A[a + 3])
  local seq = tonumber(A[a + 4 + 3 * m] or '')
  local prompt = tonumber(A[a + 5 + 3 * m] or '') or 0
  -- The request, numbered within the last report, joins the lease's landed counts.
  local function landed()
    hincrby(K[k + 1], id .. ':l', 1)
    hincrby(K[k + 1], id .. ':lt', A[a + 1])
    hincrby(K[k + 1], id .. ':lp', prompt)
  end
  if lease_open(K[k], id) then
    if seq == nil then
      hincrby(K[k + 1], id .. ':r', 1)
      hincrby(K[k + 1], id .. ':t', A[a + 1])
    elseif seq > lease_reported(K[k + 1], id) then
      redis.call('HSET', K[k + 1], id .. ':#' .. int(seq), A[a + 1] .. ':' .. int(prompt))
    else
      landed()
    end
    expire(K[k + 1], 'PEXPIRE', A[a + 2])
  elseif redis.call('ZSCORE', K[k + 2], id) or redis.call('ZSCORE', K[k + 3], id) then
    if seq == nil or seq > lease_reported(K[k + 1], id) then
      settle_all(k + 4, a + 4, m, now)
    else
      -- Reclaimed, not yet charged (lease_charged said so): its charge leaves this one out.
      landed()
    end
  end
end

-- Whether a record's lease section (K[k], A[a]) names a request its lease's charge charged: the
-- lease was charged (in LC) and the request is numbered within the last report (the charge
-- charged every reported request whose usage had not landed).
local function lease_charged(k, a)
  local id = A[a]
  if id == nil or id == '' then
    return false
  end
  local m = tonumber(A[a + 3])
  local seq = tonumber(A[a + 4 + 3 * m] or '')
  if seq == nil or lease_open(K[k], id) then
    return false
  end
  return redis.call('ZSCORE', K[k + 3], id) and seq <= lease_reported(K[k + 1], id)
end

-- Closes the open reservation `id` (R = K[1], its due entry in D = K[2]): its JSON, or nil when
-- it was not open.
local function close_reservation(id)
  local json = redis.call('HGET', K[1], id)
  if json then
    redis.call('HDEL', K[1], id)
    redis.call('ZREM', K[2], id)
  end
  return json
end

-- The usage hash's 'model' for the key of a record whose lease section starts at A[a] (see the
-- header), or nil for a record without a key.
local function key_model(a)
  local id = A[a]
  local name
  if id == '' then
    name = A[a + 1]
  elseif id ~= nil then
    name = A[a + 6 + 3 * tonumber(A[a + 3])]
  end
  if name == nil or name == '' then
    return nil
  end
  return 'api_key ' .. name
end

-- One operation on the keys K and arguments A (KEYS and ARGV, or one sub-call of a 'batch').
local function run(keys, args)
  K, A = keys, args
  local op = A[1]
  if op == 'record' then
    local id = A[2]
    local n = tonumber(A[8])
    local q = tonumber(A[10 + 3 * n] or '0') or 0
    local lease_k, lease_a = 6 + n + q, 11 + 3 * n + 4 * q
    local key = key_model(lease_a)
    check_usage(K[5], A[4], A[5], A[6], A[7], A[9 + 3 * n])
    if key then check_usage(K[5], key, A[5], A[6], A[7], A[9 + 3 * n]) end
    local json = close_reservation(id)
    if json then
      redis.call('SADD', K[4], id)
    elseif redis.call('ZSCORE', K[3], id) or lease_charged(lease_k, lease_a) then
      return 2
    elseif redis.call('SADD', K[4], id) == 0 then
      return 0
    end
    expire(K[4], 'EXPIREAT', A[3])
    local now = now_us()
    add_usage(K[5], A[4], A[5], A[6], A[7], A[9 + 3 * n])
    if key then add_usage(K[5], key, A[5], A[6], A[7], A[9 + 3 * n]) end
    -- The lease's charges before the settlements: a give-back after them is not cut at capacity.
    lease_use(lease_k, lease_a, now)
    settle_all(6, 9, n, now)
    adjust_quotas(6 + n, 10 + 3 * n, A[4], tonumber(A[5]) + tonumber(A[6]), json or nil)
    return 1
  elseif op == 'charge' then
    local id = A[2]
    local n = tonumber(A[8])
    local key = key_model(11 + 3 * n + 4 * (tonumber(A[10 + 3 * n] or '0') or 0))
    check_usage(K[4], A[4], A[5], A[6], A[7], A[9 + 3 * n])
    if key then check_usage(K[4], key, A[5], A[6], A[7], A[9 + 3 * n]) end
    local json = close_reservation(id)
    if not json then
      return 0
    end
    local now = now_us()
    remember(K[3], id, now, tonumber(A[3]))
    add_usage(K[4], A[4], A[5], A[6], A[7], A[9 + 3 * n])
    if key then add_usage(K[4], key, A[5], A[6], A[7], A[9 + 3 * n]) end
    settle_all(5, 9, n, now)
    adjust_quotas(5 + n, 10 + 3 * n, A[4], tonumber(A[5]) + tonumber(A[6]), json)
    return 1
  elseif op == 'release' then
    local id = A[2]
    local json = close_reservation(id)
    if not json then
      return 0
    end
    local reserved = reserved_of(json)
    local now = now_us()
    for i = 1, tonumber(A[3]) do
      local a = 4 + 3 * (i - 1)
      local capacity = tonumber(A[a + 1])
      local back = 1
      if A[a] == 'tokens' then back = math.min(reserved, capacity) end
      settle(K[2 + i], capacity, tonumber(A[a + 2]), back, now)
    end
    local n = tonumber(A[3])
    adjust_quotas(3 + n, 4 + 3 * n, nil, 0, json)
    return 1
  elseif op == 'rereserve' then
    local id = A[2]
    local json = redis.call('HGET', K[1], id)
    if not json then
      return 0
    end
    local before, after = reserved_of(json), reserved_of(A[3])
    redis.call('HSET', K[1], id, A[3])
    local now = now_us()
    for i = 1, tonumber(A[4]) do
      local a = 5 + 2 * (i - 1)
      local capacity = tonumber(A[a])
      settle(K[1 + i], capacity, tonumber(A[a + 1]), math.min(before, capacity) - math.min(after, capacity), now)
    end
    return 1
  elseif op == 'lease_report' then
    local id, admitted = A[2], tonumber(A[3])
    if redis.call('HEXISTS', K[1], id) == 0 then
      return 0
    end
    local before = tonumber(redis.call('HGET', K[2], id .. ':a')) or 0
    if admitted <= before then
      return 1
    end
    redis.call('HSET', K[2], id .. ':a', A[3], id .. ':at', A[4], id .. ':ap', A[6] or '0')
    -- The entries the report now covers, landed: named one by one when fewer than LU holds, else
    -- found. They join the landed counts.
    local covered, l, lt, lp = {}, 0, 0, 0
    if admitted - before <= redis.call('HLEN', K[2]) then
      local names = {}
      for s = before + 1, admitted do names[#names + 1] = id .. ':#' .. int(s) end
      for i = 1, #names, 512 do
        local values = redis.call('HMGET', K[2], unpack(names, i, math.min(i + 511, #names)))
        for j = 1, #values do
          if values[j] then
            local tokens, prompt = reserved_prompt(values[j])
            covered[#covered + 1] = names[i + j - 1]
            l, lt, lp = l + 1, lt + tokens, lp + prompt
          end
        end
      end
    else
      for _, e in ipairs(numbered(K[2], id)) do
        if e[2] <= admitted then
          covered[#covered + 1] = e[1]
          l, lt, lp = l + 1, lt + e[3], lp + e[4]
        end
      end
    end
    hdel_all(K[2], covered)
    if l > 0 then
      redis.call('HINCRBY', K[2], id .. ':l', int(l))
      redis.call('HINCRBY', K[2], id .. ':lt', int(lt))
      redis.call('HINCRBY', K[2], id .. ':lp', int(lp))
    end
    redis.call('PEXPIRE', K[2], A[5])
    return 1
  elseif op == 'lease_return' then
    local id = A[2]
    if redis.call('HDEL', K[1], id) == 0 then
      return 0
    end
    redis.call('ZREM', K[2], id)
    local gone = { id .. ':r', id .. ':t', id .. ':a', id .. ':at', id .. ':ap', id .. ':l', id .. ':lt', id .. ':lp' }
    for _, e in ipairs(numbered(K[3], id)) do gone[#gone + 1] = e[1] end
    hdel_all(K[3], gone)
    settle_all(4, 4, tonumber(A[3]), now_us())
    return 1
  elseif op == 'lease_reclaim' then
    local id = A[2]
    local json = redis.call('HGET', K[1], id)
    if not json then
      return { 0, 0, 0 }
    end
    local requests, tokens, model = 0, 0, ''
    local ok, r = pcall(cjson.decode, json)
    if ok and type(r) == 'table' then
      requests, tokens = tonumber(r.requests) or 0, tonumber(r.tokens) or 0
      if type(r.model) == 'string' then model = r.model end
    end
    local used = redis.call('HMGET', K[3], id .. ':r', id .. ':t', id .. ':a', id .. ':at')
    local used_r = (tonumber(used[1]) or 0) + (tonumber(used[3]) or 0)
    local used_t = (tonumber(used[2]) or 0) + (tonumber(used[4]) or 0)
    local gone = { id .. ':r', id .. ':t' }
    for _, e in ipairs(numbered(K[3], id)) do
      used_r, used_t = used_r + 1, used_t + e[3]
      gone[#gone + 1] = e[1]
    end
    local back_r = math.max(0, requests - used_r)
    local back_t = math.max(0, tokens - used_t)
    redis.call('HDEL', K[1], id)
    redis.call('ZREM', K[2], id)
    hdel_all(K[3], gone)
    local now = now_us()
    -- Its charge comes the longest stream lifetime later: LR and LU keep it for that and more.
    local keep = tonumber(A[3])
    redis.call('HSET', K[3], id .. ':m', model)
    if redis.call('PTTL', K[3]) < keep then
      redis.call('PEXPIRE', K[3], keep)
    end
    redis.call('ZADD', K[4], math.floor(now / 1000), id)
    if redis.call('PTTL', K[4]) < keep then
      redis.call('PEXPIRE', K[4], keep)
    end
    for i = 1, tonumber(A[4]) do
      local a = 5 + 3 * (i - 1)
      local capacity = tonumber(A[a + 1])
      local back = back_r
      if A[a] == 'tokens' then back = math.min(back_t, capacity) end
      settle(K[4 + i], capacity, tonumber(A[a + 2]), back, now)
    end
    return { 1, back_r, back_t }
  elseif op == 'lease_charges_due' then
    local now_ms = math.floor(now_us() / 1000)
    local due = redis.call('ZRANGEBYSCORE', K[1], '-inf', now_ms - tonumber(A[2]), 'LIMIT', 0, tonumber(A[3]))
    local out = {}
    for _, id in ipairs(due) do
      out[#out + 1] = id
      out[#out + 1] = redis.call('HGET', K[2], id .. ':m') or ''
    end
    return out
  elseif op == 'lease_charge' then
    local id = A[2]
    if redis.call('ZREM', K[1], id) == 0 then
      return { 0, 0, 0, 0 }
    end
    local f = { ':a', ':at', ':ap', ':l', ':lt', ':lp', ':m' }
    local names = {}
    for i, suffix in ipairs(f) do names[i] = id .. suffix end
    local got = redis.call('HMGET', K[2], unpack(names))
    local v = {}
    for i = 1, 6 do v[i] = tonumber(got[i]) or 0 end
    local model = got[7] or ''
    -- Without its model the lease was reclaimed by an older sidecar, which kept no landed counts:
    -- nothing can be told landed, so nothing is charged (as that sidecar charged nothing).
    local charged_r = 0
    if got[7] then charged_r = math.max(0, v[1] - v[4]) end
    local charged_t, charged_p = 0, 0
    if charged_r > 0 then
      charged_t = math.max(0, v[2] - v[5])
      charged_p = math.min(charged_t, math.max(0, v[3] - v[6]))
      local completion = charged_t - charged_p
      -- Exact below the cap (each product is then below it too); capped as cost_nano_usd caps.
      local cost = charged_p * (tonumber(A[4]) or 0) + completion * (tonumber(A[5]) or 0)
      if cost > MAX_COUNT then cost = MAX_COUNT end
      add_usage(K[4], model, charged_p, completion, 0, int(cost), charged_r)
      adjust_quotas(5, 6, model, charged_t, nil)
    end
    hdel_all(K[2], { names[2], names[3], names[4], names[5], names[6], names[7] })
    -- Leases LC forgets now take their <id>:a along; LU lives at least as long as LC keeps this one.
    local now = now_us()
    local keep = tonumber(A[3])
    local forgotten = redis.call('ZRANGEBYSCORE', K[3], '-inf', math.floor(now / 1000) - keep)
    local stale = {}
    for _, old in ipairs(forgotten) do stale[#stale + 1] = old .. ':a' end
    hdel_all(K[2], stale)
    if v[1] > 0 and redis.call('PTTL', K[2]) < keep then
      redis.call('PEXPIRE', K[2], keep)
    end
    remember(K[3], id, now, keep)
    return { 1, charged_r, charged_t, charged_p }
  elseif op == 'claim' then
    local now_ms = math.floor(now_us() / 1000)
    local age, claim, most = tonumber(A[2]), tonumber(A[3]), tonumber(A[4])
    local due = redis.call('ZRANGEBYSCORE', K[2], '-inf', now_ms - age, 'LIMIT', 0, most)
    local out = { redis.call('ZCARD', K[2]) }
    for _, id in ipairs(due) do
      local json = redis.call('HGET', K[1], id)
      if json then
        redis.call('ZADD', K[2], now_ms - age + claim, id)
        out[#out + 1] = id
        out[#out + 1] = json
      else
        redis.call('ZREM', K[2], id)
      end
    end
    return out
  end
  return redis.error_reply('ledger_v1.lua: unknown operation ' .. tostring(op))
end

if ARGV[1] == 'batch' then
  local out = {}
  local k, a = 1, 3
  for j = 1, tonumber(ARGV[2]) do
    local nk, na = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
    local keys, args = {}, {}
    for i = 1, nk do keys[i] = KEYS[k + i - 1] end
    for i = 1, na do args[i] = ARGV[a + 1 + i] end
    k, a = k + nk, a + 2 + na
    local op = args[1]
    if op ~= 'record' and op ~= 'charge' and op ~= 'release' then
      flush(nil)
      return redis.error_reply('ledger_v1.lua: batch of ' .. tostring(op))
    end
    OP = j
    local ok, result = pcall(run, keys, args)
    if ok and type(result) == 'number' then
      out[j] = result
    else
      out[j] = -1
    end
  end
  flush(out)
  return out
end
-- One operation alone: its deferred writes are written also when it raised an error (as its
-- writes up to the error would have been), and its error is the reply.
local ok, result = pcall(run, KEYS, ARGV)
local err = flush(nil)
if not ok then
  return redis.error_reply(error_message(result))
elseif err ~= nil then
  return redis.error_reply(err)
end
return result
