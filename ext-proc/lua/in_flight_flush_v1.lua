-- in_flight_flush_v1.lua: one sidecar replica's share of a pool's in-flight count, and the
-- pool-wide count over every replica, in one hash per pool.
--
-- Version 1. Each replica sends its cumulative counts since it started (admitted minus finished,
-- and admitted), not deltas, so a retried call after one that did land changes nothing. A request
-- admitted through one replica whose end reaches another adds +1 to the first and -1 to the
-- second: the sum over replicas is exact whichever replica sees which event. A replica that has
-- not flushed for ARGV[5] ms (its process is gone) is folded into `base`/`abase`, which keeps the
-- sums and bounds the hash to the live replicas.
--
-- Self-correction (what never ends: an Envoy killed with requests in flight, a replica that died
-- with counts it had not flushed): with ARGV[6] >= 0, the replica's upper bound on the pool's
-- in-flight requests from vLLM's own metrics (running + waiting, plus the requests that finished
-- at vLLM or were admitted within the report lag, as of the replica's previous flush), to which
-- the admissions flushed by anyone since then (admitted sum now minus ARGV[7]) are added here. A
-- total above that bound is lowered to it; when the bound is 0 (nothing at vLLM, nothing
-- finished or admitted within the lag) the total is set to 0 whatever its sign.
--
-- KEYS[1]  <prefix>:in-flight:{<pool>}
-- ARGV[1]  replica id, ARGV[2] its cumulative balance, ARGV[3] its cumulative admitted,
-- ARGV[4]  now (unix ms), ARGV[5] fold replicas silent for this many ms,
-- ARGV[6]  bound (-1: none), ARGV[7] the admitted sum the bound was computed at (-1: none)
-- ARGV[8]  (optional) count the replicas that flushed within this many ms
-- Returns {total, admitted sum, correction applied (subtracted from the total), replicas that
-- flushed within ARGV[8] ms, this one included (1 without ARGV[8])}.
local key, me, now, gone = KEYS[1], ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[5])
local live_within = tonumber(ARGV[8] or '')
local live = 0
redis.call('HSET', key, 'b:' .. me, ARGV[2], 'a:' .. me, ARGV[3], 't:' .. me, ARGV[4])
local fields = redis.call('HGETALL', key)
local values = {}
for i = 1, #fields, 2 do
  values[fields[i]] = tonumber(fields[i + 1]) or 0
end
local base, abase = values['base'] or 0, values['abase'] or 0
local total, admitted = base, abase
for field, at in pairs(values) do
  if string.sub(field, 1, 2) == 't:' then
    local id = string.sub(field, 3)
    local b, a = values['b:' .. id] or 0, values['a:' .. id] or 0
    total = total + b
    admitted = admitted + a
    if live_within and (id == me or now - at <= live_within) then
      live = live + 1
    end
    if id ~= me and now - at > gone then
      base = base + b
      abase = abase + a
      redis.call('HDEL', key, 'b:' .. id, 'a:' .. id, 't:' .. id)
    end
  end
end
local correction = 0
local bound = tonumber(ARGV[6])
if bound >= 0 then
  local seen = tonumber(ARGV[7])
  if seen >= 0 and admitted > seen then
    bound = bound + (admitted - seen)
  end
  if total > bound or (bound == 0 and total ~= 0) then
    correction = total - bound
  end
end
base = base - correction
redis.call('HSET', key, 'base', base, 'abase', abase)
redis.call('PEXPIRE', key, 7 * 86400000)
return {total - correction, admitted, correction, math.max(live, 1)}
