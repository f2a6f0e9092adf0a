-- usage_record_v1.lua: add one finished request's usage to its tenant's daily hash, exactly once.
--
-- Version 1. The sidecar retries a record whose write failed or timed out; the first apply marks
-- the record id as seen (kept 2 days), so a retry after a write that did land adds nothing.
--
-- KEYS[1]  seen-marker key of the record (same hash tag as KEYS[2]: the tenant)
-- KEYS[2]  daily usage hash: <prefix>:usage:{<tenant>}:<YYYY-MM-DD>
-- ARGV[1]  model, ARGV[2] prompt_tokens, ARGV[3] completion_tokens, ARGV[4] cached_tokens
-- Returns 1 when applied, 0 when the record had already been applied.
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', 172800) == false then
  return 0
end
local model = ARGV[1]
redis.call('HINCRBY', KEYS[2], model .. ':requests', 1)
redis.call('HINCRBY', KEYS[2], model .. ':prompt_tokens', ARGV[2])
redis.call('HINCRBY', KEYS[2], model .. ':completion_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[2], model .. ':cached_tokens', ARGV[4])
redis.call('EXPIRE', KEYS[2], 40 * 86400)
return 1
