-- token_bucket_take_v3.lua: atomically take a cost from every given token bucket, or from none,
-- and, when admitted, up to an extra lease from each, and record the admission's reservation.
--
-- Version 3 (v2 did not record the reservation; v1 had no lease: ARGV per bucket was capacity,
-- rate, cost; replies had no granted field). A lease is taken like a cost, for the sidecar to
-- admit later requests from without a round trip; it is never more than the bucket holds after
-- the cost, and unused lease tokens are given back with token_bucket_settle_v1.lua. Buckets are
-- Redis hashes {t = tokens (float), ts = last refill, microseconds since the Unix epoch, from
-- Redis TIME}. A bucket holds at most `capacity` tokens and refills at `rate_per_minute` tokens
-- per minute (continuous refill). A bucket that does not exist is full.
--
-- The reservation (when a record id is given and the take admits): the request's entry in the
-- tenant's open reservations (KEYS[n + 1], record id -> the reservation's JSON) and in their
-- index by admission time (KEYS[n + 2], score: Redis TIME in ms), which ledger_v1.lua removes
-- when the request's usage record lands (or gives the reservation back, or records it as
-- charged once the request is older than the longest stream lifetime).
--
-- KEYS[i]  bucket i, i = 1..n; KEYS[n + 1], KEYS[n + 2] the reservations hash and index (all keys
--          of one call share one hash tag: one tenant, one cluster slot)
-- ARGV[1]  number of buckets n (0: only the reservation is recorded)
-- ARGV[1 + 4(i-1) + 1..4]  capacity_i, rate_per_minute_i, cost_i, lease_i  (numbers; cost and
--                          lease may be 0)
-- ARGV[4n + 2]  record id ('' or absent: no reservation recorded), ARGV[4n + 3] its JSON,
-- ARGV[4n + 4]  ms the reservation keys live past their last write
--
-- Quotas (issue 14 item 5; optional, appended so that callers without quotas are unchanged; then
-- ARGV[4n + 2..4n + 4] and KEYS[n + 1..n + 2] are always given, with an empty record id when no
-- reservation is recorded):
-- ARGV[4n + 5]  number of quota counters q; KEYS[n + 2 + j] counter j (an integer of tokens,
--               <prefix>:quota:{<tenant>}:...:<day|month>:<label>)
-- ARGV[4n + 5 + 4(j-1) + 1..4]  hard_j, need_j, charge_j, expire_at_j (unix s)
--   A counter refuses when counter >= hard or counter + need > hard (the admission's need is 0:
--   a request is refused once the quota is used up; a lease's need is its tokens). Admitted,
--   each counter grows by its charge (the admission's reservation; 0 for a lease) and expires at
--   expire_at. Checked after the buckets: a request refused by a bucket is not refused by a quota.
--
-- Returns a flat array: { admitted (1|0), denied_bucket (1-based; 0 when admitted or refused by
--                         a quota), then for each bucket i: remaining_i (floor, after taking
--                         when admitted), reset_ms_i (ms until full again), retry_after_ms_i (0
--                         unless it lacks), granted_i (lease tokens taken; 0 unless admitted),
--                         and with quotas: denied_quota (1-based; 0 if none refused), then for
--                         each counter j: its value (after the charge when admitted) }
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n = tonumber(ARGV[1])
local tokens, capacity, rate, cost, lease = {}, {}, {}, {}, {}
local admitted, denied = 1, 0
for i = 1, n do
  local base = 1 + 4 * (i - 1)
  capacity[i] = tonumber(ARGV[base + 1])
  rate[i] = tonumber(ARGV[base + 2]) / 60000000.0 -- tokens per microsecond
  cost[i] = tonumber(ARGV[base + 3])
  lease[i] = tonumber(ARGV[base + 4])
  local state = redis.call('HMGET', KEYS[i], 't', 'ts')
  local level = tonumber(state[1])
  local ts = tonumber(state[2])
  if level == nil or ts == nil then
    level = capacity[i]
  else
    local elapsed = now - ts
    if elapsed < 0 then elapsed = 0 end
    level = math.min(capacity[i], level + elapsed * rate[i])
  end
  tokens[i] = level
  if admitted == 1 and level < cost[i] then
    admitted, denied = 0, i
  end
end
local q = tonumber(ARGV[4 * n + 5] or '0') or 0
local used, qdenied = {}, 0
for j = 1, q do
  local base = 4 * n + 5 + 4 * (j - 1)
  used[j] = tonumber(redis.call('GET', KEYS[n + 2 + j]) or '0') or 0
  local hard, need = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2])
  if admitted == 1 and (used[j] >= hard or used[j] + need > hard) then
    admitted, qdenied = 0, j
  end
end
local out = { admitted, denied }
for i = 1, n do
  local level = tokens[i]
  local granted = 0
  if admitted == 1 then
    level = level - cost[i]
    granted = math.max(0, math.min(lease[i], math.floor(level)))
    level = level - granted
  end
  local missing = capacity[i] - level
  local reset_ms = 0
  if rate[i] > 0 and missing > 0 then reset_ms = math.ceil(missing / rate[i] / 1000) end
  local retry_ms = 0
  if admitted == 0 and level < cost[i] then
    if rate[i] > 0 then retry_ms = math.ceil((cost[i] - level) / rate[i] / 1000) else retry_ms = -1 end
  end
  if admitted == 1 then
    redis.call('HSET', KEYS[i], 't', tostring(level), 'ts', tostring(now))
    -- An idle bucket is full again after reset_ms; keep it a little longer, then let it go.
    redis.call('PEXPIRE', KEYS[i], reset_ms + 60000)
  end
  out[#out + 1] = math.floor(math.max(level, 0))
  out[#out + 1] = reset_ms
  out[#out + 1] = retry_ms
  out[#out + 1] = granted
end
if q > 0 then
  out[#out + 1] = qdenied
  for j = 1, q do
    local base = 4 * n + 5 + 4 * (j - 1)
    if admitted == 1 then
      local charge = tonumber(ARGV[base + 3])
      if charge > 0 then
        used[j] = redis.call('INCRBY', KEYS[n + 2 + j], charge)
      end
      redis.call('EXPIREAT', KEYS[n + 2 + j], ARGV[base + 4])
    end
    out[#out + 1] = used[j]
  end
end
local id = ARGV[4 * n + 2]
if admitted == 1 and id ~= nil and id ~= '' then
  local keep = tonumber(ARGV[4 * n + 4])
  redis.call('HSET', KEYS[n + 1], id, ARGV[4 * n + 3])
  redis.call('ZADD', KEYS[n + 2], math.floor(now / 1000), id)
  redis.call('PEXPIRE', KEYS[n + 1], keep)
  redis.call('PEXPIRE', KEYS[n + 2], keep)
end
return out
