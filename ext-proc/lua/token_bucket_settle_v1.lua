-- token_bucket_settle_v1.lua: settle a token reservation against one bucket.
--
-- Version 1, same bucket layout as token_bucket_take_v2.lua. At admission the gateway takes the
-- reserved tokens (prompt estimate + max tokens); when the request ends it calls this script with
-- delta = reserved - used: a positive delta gives the unused part back (never above capacity), a
-- negative delta charges the excess (the level may go below zero: the debt delays later requests).
--
-- KEYS[1]  the bucket
-- ARGV[1]  capacity, ARGV[2] rate_per_minute, ARGV[3] delta (tokens)
-- Returns the bucket's level after settling, floored.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2]) / 60000000.0
local delta = tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 't', 'ts')
local level = tonumber(state[1])
local ts = tonumber(state[2])
if level == nil or ts == nil then
  -- A missing bucket reads as full: giving back to it changes nothing, and not creating it
  -- leaves a node that came back empty to token_bucket_reconcile_v1.lua.
  if delta > 0 then
    return capacity
  end
  level = capacity
else
  local elapsed = now - ts
  if elapsed < 0 then elapsed = 0 end
  level = math.min(capacity, level + elapsed * rate)
end
level = math.min(capacity, level + delta)
redis.call('HSET', KEYS[1], 't', tostring(level), 'ts', tostring(now))
local missing = capacity - level
local keep_ms = 60000
if rate > 0 and missing > 0 then keep_ms = keep_ms + math.ceil(missing / rate / 1000) end
redis.call('PEXPIRE', KEYS[1], keep_ms)
return math.floor(level)
