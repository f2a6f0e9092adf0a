-- token_bucket_reconcile_v1.lua: charge one bucket with what a sidecar admitted while Redis could
-- not decide, once Redis answers again.
--
-- Same bucket layout as token_bucket_take_v3.lua (fields t, ts), plus two fields only this script
-- reads: ex (refill above capacity that a reconciliation could not credit, for the other sidecars
-- still owing for the same outage) and exts (when it was kept). While Redis (or the cluster node
-- holding the bucket) was away from this sidecar, it admitted from its in-memory bucket; `debt` is
-- what those admissions took, net of what their settlements gave back (tokens; negative: more
-- given back than taken). `hint` is the bucket's level as Redis last answered this sidecar, plus
-- the refill since, NOT capped; `age` is how long ago (ms) that answer came.
--
-- The debt is always charged against what Redis has NOW: its level refilled as a take would see
-- it (capped at capacity). Other sidecars may have kept taking from Redis since this one's last
-- answer (a partial outage: one sidecar's sporadic timeouts), so the hint is stale: it may only
-- lower the result (never above hint - debt), never raise it. The one credit against the debt is
-- refill that Redis dropped at its capacity while this sidecar was away (its local admissions
-- used that refill as it came; without the credit the debt of a long outage under load would
-- lock the tenant out for as long again):
-- - the bucket's refill above capacity since the later of its last write (ts) and this sidecar's
--   last answer (now - age): nobody took from Redis meanwhile;
-- - ex, when a reconciliation kept it after this sidecar's last answer and within the last 60 s
--   (ex kept before that answer is not this sidecar's: takes since have used the bucket without
--   it, and do not touch it).
-- The credit is at most the debt, so the result is at most Redis's level (minus the debt beyond
-- the credit); what is not credited is kept in ex for the next sidecar. Without a hint or its age
-- nothing is credited. A bucket that is missing (its node came back empty; it would read as full:
-- a fresh burst) is rebuilt from the hint: min(capacity, hint) - debt, with the hint's refill above
-- capacity as the credit (capacity - debt without a hint). Givebacks (a negative debt) above
-- capacity are lost, as in token_bucket_settle_v1.lua.
--
-- With sidecars local through one outage (a node killed, or every one cut off), the first one's
-- uncredited refill goes to ex and the next ones' debts are credited with it: all end where one
-- bucket over the whole span would be. A take that timed out in the sidecar but ran in Redis is
-- charged twice (in Redis, and as the local admission that replaced it; a lease it granted is lost
-- to the bucket): under-admission, never over.
--
-- KEYS[1]  the bucket
-- ARGV[1]  capacity, ARGV[2] rate_per_minute, ARGV[3] debt (tokens), ARGV[4] hint ('' for none),
-- ARGV[5]  the hint's age in ms ('' or absent: unknown, nothing credited unless the bucket is
--          missing)
-- Returns the bucket's level after reconciling, floored (it may be below zero: the debt delays
-- later requests).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2]) / 60000000.0
local debt = tonumber(ARGV[3])
local hint = tonumber(ARGV[4])
local age = tonumber(ARGV[5] or '')
local seen
if hint ~= nil and age ~= nil then seen = now - math.max(age, 0) * 1000 end
local state = redis.call('HMGET', KEYS[1], 't', 'ts', 'ex', 'exts')
local level = tonumber(state[1])
local ts = tonumber(state[2])
local current, pool = capacity, 0
-- Whether ex and exts are rewritten: not when this call had no use for them (another sidecar,
-- away since before exts, may still be owed them).
local rewrite_ex = false
if level == nil or ts == nil then
  rewrite_ex = true
  if hint ~= nil then
    current = math.min(capacity, hint)
    pool = math.max(0, hint - capacity)
  end
else
  if ts > now then ts = now end
  current = math.min(capacity, level + (now - ts) * rate)
  if seen ~= nil then
    local from = math.max(ts, seen)
    local at_from = math.min(capacity, level + (from - ts) * rate)
    pool = math.max(0, at_from + (now - from) * rate - capacity)
    local ex, exts = tonumber(state[3]), tonumber(state[4])
    if ex ~= nil and exts ~= nil and exts > seen and now - exts < 60000000 then
      pool = pool + ex
      rewrite_ex = true
    end
  end
end
local credit = math.min(math.max(debt, 0), pool)
local base = current + credit
if hint ~= nil and hint < base then base = hint end
level = math.min(capacity, base - debt)
if rewrite_ex or pool > credit then
  redis.call('HSET', KEYS[1], 't', tostring(level), 'ts', tostring(now), 'ex', tostring(pool - credit), 'exts', tostring(now))
else
  redis.call('HSET', KEYS[1], 't', tostring(level), 'ts', tostring(now))
end
local missing = capacity - level
local keep_ms = 60000
if rate > 0 and missing > 0 then keep_ms = keep_ms + math.ceil(missing / rate / 1000) end
redis.call('PEXPIRE', KEYS[1], keep_ms)
return math.floor(level)
