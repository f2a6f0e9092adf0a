-- token_bucket_reconcile_v1.lua: charge one bucket with what a sidecar admitted while Redis could
-- not decide, once Redis answers again.
--
-- Same bucket layout as token_bucket_take_v3.lua (fields t, ts), plus two fields only this script
-- reads: ex (the tokens above capacity that the last reconciliation had to cut) and exts (when).
-- While Redis (or the cluster node holding the bucket) was away, the sidecar admitted from its
-- in-memory bucket; `debt` is what those admissions took, net of what their settlements gave back
-- (tokens; negative: more given back than taken). `hint` is the bucket's level as Redis last
-- answered this sidecar, plus the refill since, NOT capped (the refill of the outage, which the
-- local admissions used).
--
-- - The bucket is missing: the node came back empty (an empty bucket would read as full: a fresh
--   burst). Its level is rebuilt from the hint: hint - debt (capacity without a hint).
-- - The bucket is there (it survived, or its node reloaded it from its AOF): Redis's level
--   refilled without the cap (capped when there is no hint) plus the excess an earlier
--   reconciliation of the last 60 s cut at capacity, never above the hint, minus the debt. With two sidecars the
--   second one so charges its debt against the first one's uncapped result: after an outage
--   under load both end where one bucket over the whole span would be.
-- The result is capped at capacity (what is cut is kept in ex); it may go below zero: the debt
-- delays later requests.
--
-- KEYS[1]  the bucket
-- ARGV[1]  capacity, ARGV[2] rate_per_minute, ARGV[3] debt (tokens), ARGV[4] hint ('' for none)
-- Returns the bucket's level after reconciling, floored.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2]) / 60000000.0
local debt = tonumber(ARGV[3])
local hint = tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 't', 'ts', 'ex', 'exts')
local level = tonumber(state[1])
local ts = tonumber(state[2])
local base
if level == nil or ts == nil then
  base = hint or capacity
else
  local elapsed = now - ts
  if elapsed < 0 then elapsed = 0 end
  -- Not capped when there is a hint: a bucket that survived refilled during the outage up to
  -- capacity only, while the local admissions used the whole refill.
  base = level + elapsed * rate
  if hint == nil then base = math.min(capacity, base) end
  local ex, exts = tonumber(state[3]), tonumber(state[4])
  if ex ~= nil and exts ~= nil and now - exts < 60000000 then base = base + ex end
  if hint ~= nil and hint < base then base = hint end
end
level = base - debt
local ex = 0
if level > capacity then
  ex = level - capacity
  level = capacity
end
redis.call('HSET', KEYS[1], 't', tostring(level), 'ts', tostring(now), 'ex', tostring(ex), 'exts', tostring(now))
local missing = capacity - level
local keep_ms = 60000
if rate > 0 and missing > 0 then keep_ms = keep_ms + math.ceil(missing / rate / 1000) end
redis.call('PEXPIRE', KEYS[1], keep_ms)
return math.floor(level)
