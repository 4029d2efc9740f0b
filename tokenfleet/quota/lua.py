"""The Redis scripts. Each reserve and each reconcile is one script call (or one call of BATCH, which runs many of them
in order as if one after the other), so a decision over every scope and dimension is atomic. Time comes from Redis (TIME), not from the gateways: many gateways share the buckets and
their clocks disagree; one server clock per shard keeps refill exact and the UTC day the same for everyone.

Per scope two keys: a hash (r, t: the requests and tokens bucket levels; a: the share-integral when they were
written, which is the time itself unless the tenant is sliced, see slices.py; day, used: the daily budget of the
current UTC day) and a zset of concurrency leases (request id -> lease expiry). A day's counter matters only on
that day, so one (day, used) pair is all the daily budget needs; a reconcile for a past day leaves it alone.
Leases past their expiry (requests never reconciled) are pruned when the count reaches the limit, not on every
reserve: a count under the limit with them is under it without them, so a zset never holds more than the limit.
A hash expires once it would read the same as an absent one (buckets full again, the day's usage over), or up to
EXPIRY_SLACK_MS later: it remembers the expiry it was last given (x, with xa: the `a` written with it) and is given a
new one, with that much slack, only when it needs a later one. Most writes then cost no PEXPIRE. A TTL never falls
short of what the hash needs: a hash without x, or whose xa is not its `a` (the last write was made by a script that
does not keep x, e.g. an older gateway during a rolling upgrade), is given a new expiry on its next write.

Limits travel as four arguments per scope, rpm tpm conc tpd (-1: unlimited): four numbers cost the script a
fraction of what parsing one string of them did. Bucket levels and times are replied as strings of 17 digits, so
Python reads back exactly the doubles the script decided on and explains a refusal from the same values; whole
numbers (day, live, used) as integers, which cost no formatting; unlimited as nil. A value written or replied more
than once is formatted once in Lua; a value written once goes to redis.call as a number (Redis formats it with the
same 17 digits, in C).

Every redis.call costs server time whatever it does, so the scripts make as few as the semantics allow: a reserve
of two scopes with per-minute and concurrency limits makes 11 (TIME, then per scope HMGET ZCARD HSET ZADD PEXPIRE),
a reconcile 8 (SET NX, TIME, then per scope HMGET HSET ZREM); 19 a pair instead of 25 saved 5-10 % of the server
time (docs/benchmarks/quota.md): most of it is the script call itself and the Lua around the commands.
"""

from __future__ import annotations

# Calling TIME before writing needs effects replication: the default since Redis 5.
PRELUDE = r"""
local DAY = 86400
local EXPIRY_SLACK_MS = 60000
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function num(x)
  if x == '-' then return x end
  return string.format('%.17g', x)
end
-- reply elements ('-': unlimited, nil in the reply): a level as 17 digits, a whole number as an integer
local function level(x)
  if x == '-' then return false end
  return string.format('%.17g', x)
end
local function count(x)
  if x == '-' then return false end
  return x
end
-- one scope's limits: the four arguments from ARGV[first]
local function limits_at(first)
  return {tonumber(ARGV[first]), tonumber(ARGV[first + 1]), tonumber(ARGV[first + 2]), tonumber(ARGV[first + 3])}
end
-- s: the slice's share of capacity and rate; a: integral of s over time (share-seconds). Not sliced: s = 1, a = now.
local function share_of(key, now, s0, write)
  if key == nil then return 1, now end
  local h = redis.call('HMGET', key, 's', 'acc', 'since')
  if not h[1] then
    if write then redis.call('HSET', key, 's', s0, 'acc', 0, 'since', now) end
    return s0, 0
  end
  local s = tonumber(h[1])
  return s, tonumber(h[2]) + s * (now - tonumber(h[3]))
end
local function refill(stored, limit, s, elapsed)
  if not stored then return limit * s end  -- absent: full
  return math.min(limit * s, tonumber(stored) + elapsed * limit / 60)
end
-- {r, t, used}: the buckets refilled to now and today's usage ('-' where unlimited)
local function scope_levels(h, lim, s, a, day)
  local elapsed = 0
  if h[3] then elapsed = math.max(0, a - tonumber(h[3])) end
  local st = {'-', '-', '-'}
  if lim[1] >= 0 then st[1] = refill(h[1], lim[1], s, elapsed) end
  if lim[2] >= 0 then st[2] = refill(h[2], lim[2], s, elapsed) end
  if lim[4] >= 0 then
    st[3] = 0
    if tonumber(h[4]) == day then st[3] = tonumber(h[5]) end
  end
  return st
end
-- scope_levels of the hash, and the hash as read (its expiry fields are for write_scope)
local function read_scope(key, lim, s, a, day)
  local h = redis.call('HMGET', key, 'r', 't', 'a', 'day', 'used', 'x', 'xa')
  return scope_levels(h, lim, s, a, day), h
end
-- h: the hash as read_scope read it; a_text: num(a), formatted once per script call
local function write_scope(key, lim, st, s, a_text, now, day, h)
  local fields, idle = {'a', a_text, 'xa', a_text}, 0
  for j = 1, 2 do
    if lim[j] > 0 then
      fields[#fields + 1] = (j == 1) and 'r' or 't'
      fields[#fields + 1] = st[j]
      idle = math.max(idle, (lim[j] * s - st[j]) / (lim[j] / 60 * s))
    end
  end
  if lim[4] >= 0 then
    fields[#fields + 1] = 'day'; fields[#fields + 1] = day
    fields[#fields + 1] = 'used'; fields[#fields + 1] = st[3]
    if st[3] > 0 then idle = math.max(idle, (day + 1) * DAY - now) end
  end
  local expiry = math.ceil((now + math.min(idle, 2 * DAY) + 60) * 1000)
  if h[6] and h[7] == h[3] and tonumber(h[6]) >= expiry then
    redis.call('HSET', key, unpack(fields))
  else
    expiry = expiry + EXPIRY_SLACK_MS
    fields[#fields + 1] = 'x'; fields[#fields + 1] = expiry
    redis.call('HSET', key, unpack(fields))
    redis.call('PEXPIREAT', key, expiry)
  end
end

-- The rule of a reserve, for RESERVE and BATCH alike. lim: rpm tpm conc tpd (0: none allowed, -1: unlimited);
-- st: requests left, tokens left, tokens used today.
local function within_limits(lim, st, tokens)
  if lim[1] == 0 or (lim[1] > 0 and st[1] < 1) then return false end
  if lim[2] == 0 or (lim[2] > 0 and st[2] < tokens) then return false end
  if lim[4] == 0 or (lim[4] > 0 and st[3] + tokens > lim[4]) then return false end
  return true
end

-- A scope's state once a reserve of `tokens` is charged, from what it saw (requests, tokens, live, used).
local function charged(lim, seen, tokens)
  local st = {seen[1], seen[2], seen[4]}
  if lim[1] > 0 then st[1] = seen[1] - 1 end
  if lim[2] > 0 then st[2] = seen[2] - tokens end
  if lim[4] > 0 then st[3] = seen[4] + tokens end
  return st
end
"""

# KEYS: per scope its hash and its lease zset; then the share hash when sliced.
# ARGV: request_id, tokens, lease_s, n_scopes, initial share (0: not sliced), then per scope rpm tpm conc tpd.
# Returns [allowed, now, day, share] then per scope [requests, tokens, live, used] as seen before charging: allowed,
# day, live and used as integers, the others as 17-digit strings, nil where unlimited. `live` may count leases past
# their expiry while it is under the limit (see above); at or over it, it is exact.
RESERVE = (
    PRELUDE
    + r"""
local request_id, tokens, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n, s0 = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = clock()
local day = math.floor(now / DAY)
local share_key = nil
if s0 > 0 then share_key = KEYS[2 * n + 1] end
local s, a = share_of(share_key, now, s0, true)
if share_key then
  redis.call('HINCRBY', share_key, 'demand', math.max(tokens, 1))
  redis.call('EXPIRE', share_key, 2 * DAY)
end
local now_text = num(now)
local ok, lims, seen, hashes = true, {}, {}, {}
for i = 1, n do
  local lim = limits_at(2 + 4 * i)
  local st, h = read_scope(KEYS[2 * i - 1], lim, s, a, day)
  local live = '-'
  if lim[3] >= 0 then
    -- leases past their expiry (requests never reconciled) are pruned only when they could make the difference: a
    -- count that includes them and is under the limit is under it without them too
    live = redis.call('ZCARD', KEYS[2 * i])
    if live >= lim[3] then
      live = live - redis.call('ZREMRANGEBYSCORE', KEYS[2 * i], '-inf', now_text)
      if live >= lim[3] then ok = false end
    end
  end
  if not within_limits(lim, st, tokens) then ok = false end
  lims[i], seen[i], hashes[i] = lim, {st[1], st[2], live, st[3]}, h
end
if ok then
  local a_text = now_text
  if share_key then a_text = num(a) end
  local lease_end, lease_ttl = nil, nil
  for i = 1, n do
    local lim = lims[i]
    local st = charged(lim, seen[i], tokens)
    if lim[1] > 0 or lim[2] > 0 or lim[4] > 0 then
      write_scope(KEYS[2 * i - 1], lim, st, s, a_text, now, day, hashes[i])
    end
    if lim[3] > 0 then
      lease_end = lease_end or num(now + lease)
      lease_ttl = lease_ttl or math.ceil((lease + 60) * 1000)
      redis.call('ZADD', KEYS[2 * i], lease_end, request_id)
      redis.call('PEXPIRE', KEYS[2 * i], lease_ttl)
    end
  end
end
local out = {ok and 1 or 0, now_text, day, num(s)}
for i = 1, n do
  local v = seen[i]
  out[#out + 1] = level(v[1]); out[#out + 1] = level(v[2]); out[#out + 1] = count(v[3]); out[#out + 1] = count(v[4])
end
return out
"""
)

# KEYS: per scope its hash and its lease zset; then the share hash when sliced; then the request's "reconciled"
# marker (last: the keys and arguments that change from call to call are next to each other, see CallTemplate).
# ARGV: request_id, extra (used - reserved: < 0 refunds), day number charged, n_scopes, marker ttl s, initial share,
# then per scope rpm tpm conc tpd. Returns 1, or 0 when this request was reconciled before.
RECONCILE = (
    PRELUDE
    + r"""
local n = tonumber(ARGV[4])
if not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'EX', ARGV[5]) then return 0 end
local now, s0, extra, charged_day = clock(), tonumber(ARGV[6]), tonumber(ARGV[2]), tonumber(ARGV[3])
local day = math.floor(now / DAY)
local share_key = nil
if s0 > 0 then share_key = KEYS[2 * n + 1] end
local s, a = share_of(share_key, now, s0, true)
local a_text = nil
for i = 1, n do
  local lim = limits_at(3 + 4 * i)
  if lim[2] > 0 or (lim[4] > 0 and charged_day == day) then
    local st, h = read_scope(KEYS[2 * i - 1], lim, s, a, day)
    if lim[2] > 0 then st[2] = math.min(lim[2] * s, st[2] - extra) end
    if lim[4] > 0 and charged_day == day then st[3] = math.max(0, st[3] + extra) end
    a_text = a_text or num(a)
    write_scope(KEYS[2 * i - 1], lim, st, s, a_text, now, day, h)
  end
  if lim[3] >= 0 then redis.call('ZREM', KEYS[2 * i], ARGV[1]) end
end
return 1
"""
)

# More tokens for a running request. KEYS: per scope its hash; then the request's "reconciled" marker; then the share
# hash when sliced. ARGV: at_least, at_most, day number charged, n_scopes, initial share, then per scope
# rpm tpm conc tpd. Grants what every scope's tokens bucket and (on the day the request was charged) daily budget
# hold, up to at_most; nothing when that is under at_least or the request was reconciled. Returns the grant.
EXTEND = (
    PRELUDE
    + r"""
local least, most, charged_day = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n, s0 = tonumber(ARGV[4]), tonumber(ARGV[5])
if redis.call('EXISTS', KEYS[n + 1]) == 1 then return 0 end
local now = clock()
local day = math.floor(now / DAY)
local share_key = nil
if s0 > 0 then share_key = KEYS[n + 2] end
local s, a = share_of(share_key, now, s0, true)
local grant, lims, states, hashes = most, {}, {}, {}
for i = 1, n do
  local lim = limits_at(2 + 4 * i)
  local st, h = read_scope(KEYS[i], lim, s, a, day)
  if lim[2] >= 0 then grant = math.min(grant, math.floor(st[2])) end
  if lim[4] >= 0 and charged_day == day then grant = math.min(grant, lim[4] - st[3]) end
  lims[i], states[i], hashes[i] = lim, st, h
end
if grant < least then return 0 end
local a_text = num(a)
for i = 1, n do
  local lim, st = lims[i], states[i]
  local daily = lim[4] > 0 and charged_day == day
  if lim[2] > 0 then st[2] = st[2] - grant end
  if daily then st[3] = st[3] + grant end
  if lim[2] > 0 or daily then write_scope(KEYS[i], lim, st, s, a_text, now, day, hashes[i]) end
end
if share_key then
  redis.call('HINCRBY', share_key, 'demand', grant)
  redis.call('EXPIRE', share_key, 2 * DAY)
end
return grant
"""
)

# Read only. KEYS: the scope's hash, its zset[, the share hash]. ARGV: rpm tpm conc tpd, initial share.
# Returns "share requests tokens live used".
INSPECT = (
    PRELUDE
    + r"""
local now, s0 = clock(), tonumber(ARGV[5])
local share_key = nil
if s0 > 0 then share_key = KEYS[3] end
local s, a = share_of(share_key, now, s0, false)
local lim = limits_at(1)
local st = read_scope(KEYS[1], lim, s, a, math.floor(now / DAY))
local live = '-'
if lim[3] >= 0 then live = redis.call('ZCOUNT', KEYS[2], '(' .. num(now), '+inf') end
return table.concat({num(s), num(st[1]), num(st[2]), num(live), num(st[3])}, ' ')
"""
)

# A slice's share hash. KEYS: share. ARGV: initial share. Returns "share demand-since-the-last-call".
TAKE_DEMAND = (
    PRELUDE
    + r"""
local s = share_of(KEYS[1], clock(), tonumber(ARGV[1]), true)
local demand = redis.call('HGET', KEYS[1], 'demand') or '0'
redis.call('HSET', KEYS[1], 'demand', '0')
redis.call('EXPIRE', KEYS[1], 2 * DAY)
return num(s) .. ' ' .. demand
"""
)

# KEYS: share. ARGV: new share, initial share. Closes the integral at the old share, then switches.
SET_SHARE = (
    PRELUDE
    + r"""
local now = clock()
local _, a = share_of(KEYS[1], now, tonumber(ARGV[2]), true)
redis.call('HSET', KEYS[1], 's', ARGV[1], 'acc', num(a), 'since', num(now))
redis.call('EXPIRE', KEYS[1], 2 * DAY)
return 1
"""
)

# Many RESERVE and RECONCILE calls as one script call (RedisStore sends a tick's reserves and reconciles so), run in
# order with exactly the effects and replies of the single scripts run one after the other at one instant (one TIME
# for the batch). A batch pays the script call, the clock and each key's reads, expiries and most of its writes once
# instead of once per call: each key is read once (HMGET, ZCARD) and its state kept in a Lua table that every call
# of the batch reads and updates; a hash is written once at the end (one HSET of the fields the batch changed, one
# PEXPIREAT when a call needed a later expiry: the last one); a lease zset's ZADD and ZREM wait until its count is
# next needed or the end (all waiting members in one call; the count is then updated by what ZADD and ZREM report,
# so it is what ZCARD would say), its PEXPIRE happens once at the end; a share hash's demand is added once. Only the
# reconciled markers are written call by call (SET NX). The hashes keep the fields the single scripts write (x, xa
# included), so gateways of the previous version, which send single calls, share the keys during a rolling upgrade.
#
# Against the single scripts it saves most where calls share scopes (server time of batches of 32 reserves, then of
# their 32 reconciles: 42 % less when 3 tenants made them, about 20 % less when 300 did: then the saving is mostly
# the script call and the clock). The Lua around the commands costs server time too (as much as the reads), so the
# state is kept in flat tables, and as few tables as possible are made per call.
#
# All keys of all calls are in KEYS, in call order (the batch spans tenants, so their hash tags differ: a batch runs
# on one standalone server; a Redis Cluster would need batches per slot). Per call, in KEYS its single script's keys
# and in ARGV a kind then its single script's arguments:
#   'r' request_id tokens lease n s0 limits...            KEYS: per scope hash, zset; [share]
#   'c' request_id extra day n marker_ttl s0 limits...    KEYS: per scope hash, zset; [share]; marker
# Returns one reply per call, each what its single script replies; a call whose commands fail (e.g. WRONGTYPE on a
# key these scripts never wrote) gets its error in its place and the others go on. A write left for the end that
# fails is the exception: the other writes are still made, and the whole batch answers that error.
BATCH = (
    PRELUDE
    + r"""
local now = clock()
local day = math.floor(now / DAY)
local now_text = num(now)
local lease_ends = {}  -- lease -> num(now + lease)
local function share_text(s)
  if s == 1 then return '1' end
  return num(s)
end
-- a hash: its HMGET reply, kept up to date, then [8] written, [9] r written, [10] t written, [11] day and used
-- written, [12] the expiry to set (false: none)
local hashes, hash_order = {}, {}
-- a lease zset: its count (once read), its TTL to set, and the members to add (score) or remove (false) when it is
-- next counted or at the end: one member as itself (in waiting, its score in score_of), more as one table of the
-- names in order and name -> score or false
local counts, ttls, waiting, score_of, zset_order = {}, {}, {}, {}, {}
local shares, share_order = {}, {}

local function hash_of(key)
  local h = hashes[key]
  if not h then
    h = redis.call('HMGET', key, 'r', 't', 'a', 'day', 'used', 'x', 'xa')
    h[8], h[9], h[10], h[11], h[12] = false, false, false, false, false
    hashes[key] = h
    hash_order[#hash_order + 1] = key
  end
  return h
end
-- read_scope on the batch's state of the hash
local function read_cached(h, lim, s, a)
  return scope_levels(h, lim, s, a, day)
end
-- write_scope on the batch's state of the hash, written at the end: a value kept as a number reads back as the same
-- number (Redis writes it with 17 digits), a_text as the same string
local function write_cached(h, lim, st, s, a_text)
  local idle = 0
  h[8] = true
  for j = 1, 2 do
    if lim[j] > 0 then
      h[j], h[8 + j] = st[j], true
      idle = math.max(idle, (lim[j] * s - st[j]) / (lim[j] / 60 * s))
    end
  end
  if lim[4] >= 0 then
    h[4], h[5], h[11] = day, st[3], true
    if st[3] > 0 then idle = math.max(idle, (day + 1) * DAY - now) end
  end
  local expiry = math.ceil((now + math.min(idle, 2 * DAY) + 60) * 1000)
  if not (h[6] and h[7] == h[3] and tonumber(h[6]) >= expiry) then
    expiry = expiry + EXPIRY_SLACK_MS
    h[6], h[12] = expiry, expiry
  end
  h[3], h[7] = a_text, a_text
end

local function zset_touch(key)
  if ttls[key] == nil then
    ttls[key] = false
    zset_order[#zset_order + 1] = key
  end
end
-- a member to add (its score) or remove (false) when the zset is next counted or at the end
local function zset_later(key, member, score)
  local w = waiting[key]
  if not w or w == member then
    waiting[key], score_of[key] = member, score
    return
  end
  if type(w) ~= 'table' then
    w = {w, [w] = score_of[key]}
    waiting[key] = w
  end
  if w[member] == nil then w[#w + 1] = member end
  w[member] = score
end
local function zset_flush(key)
  local w = waiting[key]
  if not w then return end
  waiting[key] = nil
  local change = 0
  if type(w) ~= 'table' then
    local score = score_of[key]
    if score then change = redis.call('ZADD', key, score, w) else change = -redis.call('ZREM', key, w) end
  else
    local adds, removes = {}, {}
    for _, member in ipairs(w) do
      local score = w[member]
      if score then
        adds[#adds + 1] = score; adds[#adds + 1] = member
      else
        removes[#removes + 1] = member
      end
    end
    if #adds > 0 then change = redis.call('ZADD', key, unpack(adds)) end
    if #removes > 0 then change = change - redis.call('ZREM', key, unpack(removes)) end
  end
  if counts[key] then counts[key] = counts[key] + change end
end
-- ZCARD as a call of its own would read it now
local function zset_count(key)
  zset_flush(key)
  local c = counts[key]
  if not c then
    c = redis.call('ZCARD', key)
    counts[key] = c
  end
  return c
end

-- share_of(key, now, s0, true) on the batch's state of the share hash (created at the end when absent)
local function share_at(key, s0)
  if key == nil then return 1, now, nil end
  local c = shares[key]
  if not c then
    local h = redis.call('HMGET', key, 's', 'acc', 'since')
    c = {demand = 0, created = false}
    if h[1] then
      c.s, c.acc, c.since = tonumber(h[1]), tonumber(h[2]), tonumber(h[3])
    else
      c.s, c.acc, c.since, c.created = s0, 0, now, true
    end
    shares[key] = c
    share_order[#share_order + 1] = key
  end
  return c.s, c.acc + c.s * (now - c.since), c
end

local function reserve(k, v, n, s0)
  local request_id, tokens, lease = ARGV[v + 1], tonumber(ARGV[v + 2]), tonumber(ARGV[v + 3])
  local share_key = nil
  if s0 > 0 then share_key = KEYS[k + 2 * n] end
  local s, a, share = share_at(share_key, s0)
  if share then share.demand = share.demand + math.max(tokens, 1) end
  local ok, lims, seen = true, {}, {}
  for i = 1, n do
    local lim = limits_at(v + 2 + 4 * i)
    local st = read_cached(hash_of(KEYS[k + 2 * i - 2]), lim, s, a)
    local live = '-'
    if lim[3] >= 0 then
      local zkey = KEYS[k + 2 * i - 1]
      zset_touch(zkey)
      live = zset_count(zkey)
      if live >= lim[3] then
        live = live - redis.call('ZREMRANGEBYSCORE', zkey, '-inf', now_text)
        counts[zkey] = live
        if live >= lim[3] then ok = false end
      end
    end
    if not within_limits(lim, st, tokens) then ok = false end
    lims[i], seen[i] = lim, {st[1], st[2], live, st[3]}
  end
  if ok then
    local a_text = now_text
    if share_key then a_text = num(a) end
    local lease_end, lease_ttl = nil, nil
    for i = 1, n do
      local lim = lims[i]
      local st = charged(lim, seen[i], tokens)
      if lim[1] > 0 or lim[2] > 0 or lim[4] > 0 then
        write_cached(hash_of(KEYS[k + 2 * i - 2]), lim, st, s, a_text)
      end
      if lim[3] > 0 then
        if not lease_end then
          lease_end = lease_ends[lease]
          if not lease_end then
            lease_end = num(now + lease)
            lease_ends[lease] = lease_end
          end
        end
        lease_ttl = lease_ttl or math.ceil((lease + 60) * 1000)
        local zkey = KEYS[k + 2 * i - 1]
        zset_later(zkey, request_id, lease_end)
        ttls[zkey] = lease_ttl
      end
    end
  end
  local out = {ok and 1 or 0, now_text, day, share_text(s)}
  for i = 1, n do
    local v2 = seen[i]
    out[#out + 1] = level(v2[1]); out[#out + 1] = level(v2[2])
    out[#out + 1] = count(v2[3]); out[#out + 1] = count(v2[4])
  end
  return out
end

local function reconcile(k, v, n, s0, marker)
  if not redis.call('SET', marker, '1', 'NX', 'EX', ARGV[v + 5]) then return 0 end
  local request_id, extra, charged_day = ARGV[v + 1], tonumber(ARGV[v + 2]), tonumber(ARGV[v + 3])
  local share_key = nil
  if s0 > 0 then share_key = KEYS[k + 2 * n] end
  local s, a = share_at(share_key, s0)
  local a_text = nil
  for i = 1, n do
    local lim = limits_at(v + 3 + 4 * i)
    if lim[2] > 0 or (lim[4] > 0 and charged_day == day) then
      local c = hash_of(KEYS[k + 2 * i - 2])
      local st = read_cached(c, lim, s, a)
      if lim[2] > 0 then st[2] = math.min(lim[2] * s, st[2] - extra) end
      if lim[4] > 0 and charged_day == day then st[3] = math.max(0, st[3] + extra) end
      a_text = a_text or num(a)
      write_cached(c, lim, st, s, a_text)
    end
    if lim[3] >= 0 then
      local zkey = KEYS[k + 2 * i - 1]
      zset_touch(zkey)
      zset_later(zkey, request_id, false)
    end
  end
  return 1
end

local replies, k, v = {}, 1, 1
while v <= #ARGV do
  local kind = ARGV[v]
  local ok, reply
  if kind == 'r' then
    local n, s0 = tonumber(ARGV[v + 4]), tonumber(ARGV[v + 5])
    ok, reply = pcall(reserve, k, v, n, s0)
    k, v = k + 2 * n + ((s0 > 0) and 1 or 0), v + 6 + 4 * n
  elseif kind == 'c' then
    local n, s0 = tonumber(ARGV[v + 4]), tonumber(ARGV[v + 6])
    local nkeys = 2 * n + ((s0 > 0) and 1 or 0) + 1
    ok, reply = pcall(reconcile, k, v, n, s0, KEYS[k + nkeys - 1])
    k, v = k + nkeys, v + 7 + 4 * n
  else
    return redis.error_reply('ERR batch: unknown call kind ' .. tostring(kind))
  end
  if not ok then
    if type(reply) ~= 'table' or not reply.err then reply = {err = tostring(reply)} end
  end
  replies[#replies + 1] = reply
end

-- The writes the calls left for the end. A key of the wrong type (never one these scripts wrote) fails its write
-- alone; the others are still made, and the batch then answers that error for every call.
local failed = nil
local function write(command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then failed = failed or reply end
end
local names = {'r', 't'}
for _, key in ipairs(hash_order) do
  local h = hashes[key]
  if h[8] then
    local fields = {'a', h[3], 'xa', h[7]}
    for j = 1, 2 do
      if h[8 + j] then fields[#fields + 1] = names[j]; fields[#fields + 1] = h[j] end
    end
    if h[11] then
      fields[#fields + 1] = 'day'; fields[#fields + 1] = h[4]
      fields[#fields + 1] = 'used'; fields[#fields + 1] = h[5]
    end
    if h[12] then fields[#fields + 1] = 'x'; fields[#fields + 1] = h[12] end
    write('HSET', key, unpack(fields))
    if h[12] then write('PEXPIREAT', key, h[12]) end
  end
end
for _, key in ipairs(zset_order) do
  local ok, err = pcall(zset_flush, key)
  if not ok then failed = failed or err end
  if ttls[key] then write('PEXPIRE', key, ttls[key]) end
end
for _, key in ipairs(share_order) do
  local c = shares[key]
  if c.created then write('HSET', key, 's', c.s, 'acc', 0, 'since', now) end
  if c.demand > 0 then
    write('HINCRBY', key, 'demand', c.demand)
    write('EXPIRE', key, 2 * DAY)
  end
end
if failed then
  if type(failed) ~= 'table' or not failed.err then failed = {err = tostring(failed)} end
  return failed
end
return replies
"""
)

# A local lease (leases.py): budget of ONE scope a gateway process takes ahead, to decide its requests' reserves and
# reconciles in memory. KEYS: the scope's hash and lease zset. ARGV: slot members' prefix, requests, tokens, slots,
# slot_ttl, lease_s, keep, then rpm tpm conc tpd. Granted only when no limit is 0 and every limited dimension keeps
# at least `keep` of its limit afterwards (near a limit, each request is decided here, exactly, as RESERVE does);
# charges the requests and tokens as RESERVE charges one request, and adds the slots to the zset as members
# prefix..i (1..slots) expiring after slot_ttl (REFRESH_SLOTS renews them while their gateway lives: a killed one's
# come free soon); the zset's own TTL is RESERVE's, from lease_s. Returns [granted, now, day, requests, tokens, live,
# used] as seen before charging (as RESERVE replies a scope).
LEASE = (
    PRELUDE
    + r"""
local prefix, n, tokens, slots = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local slot_ttl, lease, keep = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local lim = limits_at(8)
local now = clock()
local day = math.floor(now / DAY)
local now_text = num(now)
local st, h = read_scope(KEYS[1], lim, 1, now, day)
local ok, live = lim[1] ~= 0 and lim[2] ~= 0 and lim[3] ~= 0 and lim[4] ~= 0, '-'
if lim[3] >= 0 then
  live = redis.call('ZCARD', KEYS[2])
  if live + slots > lim[3] * (1 - keep) then
    live = live - redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_text)
    if live + slots > lim[3] * (1 - keep) then ok = false end
  end
end
if lim[1] >= 0 and st[1] - n < lim[1] * keep then ok = false end
if lim[2] >= 0 and st[2] - tokens < lim[2] * keep then ok = false end
if lim[4] >= 0 and st[3] + tokens > lim[4] * (1 - keep) then ok = false end
local out = {ok and 1 or 0, now_text, day, level(st[1]), level(st[2]), count(live), count(st[3])}
if ok then
  if lim[1] > 0 then st[1] = st[1] - n end
  if lim[2] > 0 then st[2] = st[2] - tokens end
  if lim[4] > 0 then st[3] = st[3] + tokens end
  if lim[1] > 0 or lim[2] > 0 or lim[4] > 0 then write_scope(KEYS[1], lim, st, 1, now_text, now, day, h) end
  if lim[3] > 0 and slots > 0 then
    local members, lease_end = {}, num(now + slot_ttl)
    for i = 1, slots do
      members[#members + 1] = lease_end; members[#members + 1] = prefix .. i
    end
    redis.call('ZADD', KEYS[2], unpack(members))
    redis.call('PEXPIRE', KEYS[2], math.ceil((lease + 60) * 1000))
  end
end
return out
"""
)

# What leases give back, each once (a marker per settlement, as RECONCILE's), many leases in one call. KEYS: per
# settlement its scope's hash and lease zset, and its marker. ARGV: marker ttl s, then per settlement: requests back,
# tokens back (< 0: charges the lease's debt, as a reconcile's extra does), day number the lease was charged on, rpm
# tpm conc tpd, the number of slot members to remove, then those members. Buckets are refilled by what comes back,
# never above their limits; the daily budget only on the lease's day. Returns per settlement 1, or 0 when it was
# made before.
SETTLE = (
    PRELUDE
    + r"""
local ttl, now = ARGV[1], clock()
local day, now_text = math.floor(now / DAY), num(now)
local out, at = {}, 2
for k = 1, #KEYS / 3 do
  local hash, zset, marker = KEYS[3 * k - 2], KEYS[3 * k - 1], KEYS[3 * k]
  local back_r, back_t, charged_day = tonumber(ARGV[at]), tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
  local lim = limits_at(at + 3)
  local members = tonumber(ARGV[at + 7])
  local first = at + 8
  at = first + members
  if redis.call('SET', marker, '1', 'NX', 'EX', ttl) then
    local daily = lim[4] > 0 and charged_day == day and back_t ~= 0
    if (lim[1] > 0 and back_r ~= 0) or (lim[2] > 0 and back_t ~= 0) or daily then
      local st, h = read_scope(hash, lim, 1, now, day)
      if lim[1] > 0 then st[1] = math.min(lim[1], st[1] + back_r) end
      if lim[2] > 0 then st[2] = math.min(lim[2], st[2] + back_t) end
      if daily then st[3] = math.max(0, st[3] - back_t) end
      write_scope(hash, lim, st, 1, now_text, now, day, h)
    end
    if members > 0 then redis.call('ZREM', zset, unpack(ARGV, first, at - 1)) end
    out[k] = 1
  else
    out[k] = 0
  end
end
return out
"""
)

# Renews the slots of leases a gateway holds. KEYS: per lease its scope's zset. ARGV: slot_ttl, then per lease its
# slot members' prefix and number of slots. Members already given back stay gone (ZADD XX only updates).
REFRESH_SLOTS = (
    PRELUDE
    + r"""
local until_text = num(clock() + tonumber(ARGV[1]))
for k = 1, #KEYS do
  local prefix, slots = ARGV[2 * k], tonumber(ARGV[2 * k + 1])
  if slots > 0 then
    local members = {}
    for i = 1, slots do
      members[#members + 1] = until_text; members[#members + 1] = prefix .. i
    end
    redis.call('ZADD', KEYS[k], 'XX', unpack(members))
  end
end
return 1
"""
)
