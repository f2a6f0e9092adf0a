-- usage_record_v2.lua: add one finished request's usage to its tenant's daily hash, exactly once,
-- in bounded space.
--
-- Version 2. The sidecar retries a record whose write failed or timed out. The first apply adds
-- the record id to the set of ids applied in the record's window (10 s of finish time, one set
-- per tenant and window), which expires at the time the sidecar gives (the window's end, or now
-- if later, plus the retention), so a retry after a write that did land adds nothing. The sidecar
-- never retries a record past that retention after an attempt that may have landed (it logs and
-- counts it instead), so the sets need not outlive it. Version 1 kept one key per record for two
-- days.
--
-- KEYS[1]  applied ids of the window: <prefix>:usage-seen:{<tenant>}:<window start, unix s>
-- KEYS[2]  daily usage hash: <prefix>:usage:{<tenant>}:<YYYY-MM-DD> (same hash tag: the tenant)
-- ARGV[1]  record id, ARGV[2] unix time (s) at which KEYS[1] expires
-- ARGV[3]  model, ARGV[4] prompt_tokens, ARGV[5] completion_tokens, ARGV[6] cached_tokens
-- Returns 1 when applied, 0 when the record had already been applied.
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('EXPIREAT', KEYS[1], ARGV[2])
local model = ARGV[3]
redis.call('HINCRBY', KEYS[2], model .. ':requests', 1)
redis.call('HINCRBY', KEYS[2], model .. ':prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[2], model .. ':completion_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[2], model .. ':cached_tokens', ARGV[6])
redis.call('EXPIRE', KEYS[2], 40 * 86400)
return 1
