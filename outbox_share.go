package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// outboxPartitions cuts the outbox into shares by aggregate: an event's
// partition is a hash of its aggregate type and id, computed by Postgres in
// the claim query, so all events of one aggregate sit in one partition and
// one poller at a time delivers them, in order. Every instance must cut the
// same way: it is a constant, and changing it needs every poller stopped
// (docs/delivery.md).
const outboxPartitions = 32

// outboxPartitionExpr is an event's partition in SQL. The migration
// outbox_partitioned_delivery indexes it, character for character, with the
// pending events' ids.
const outboxPartitionExpr = `((hashtext(aggregate_type || '/' || aggregate_id) & 2147483647) % 32)`

// outboxPartitionLockClass is the first key of the per-partition advisory
// locks, pg_try_advisory_xact_lock(class, partition), derived from this
// service's advisory lock: the two-key locks are a keyspace of their own, so
// they never meet the one-key delivery lock.
func outboxPartitionLockClass() int32 {
	k := int64(advisoryLockKey)
	return int32(k ^ k>>32)
}

// outboxShare is which partitions this instance's poller delivers: the
// pollers alive (a sorted set in Redis, each member with the expiry of its
// last beat) are sorted by instance id and partition p goes to the member at
// p mod their number. Members join when their poller starts, refresh with
// every beat and leave when it stops; each join or leave is announced, so
// the others take their new share at once. A poller that dies leaves its
// partitions until its entry expires (the heartbeat TTL).
//
// The share spreads the work; it does not guard it. While members disagree
// (one has heard of a change, another not yet) two pollers may both think
// they own a partition: the per-partition advisory lock taken by the claim
// lets one deliver it at a time, so an aggregate's events still go out in
// order, once. And when Redis cannot be read for a TTL, every poller takes
// every partition: delivery goes on, only without the spread.
type outboxShare struct {
	rdb        *redis.Client
	instanceID string
	ttl        time.Duration // a member whose last beat is older is gone
	call       time.Duration // one Redis call
	log        *logrus.Entry

	mu       sync.Mutex
	parts    []int32 // never modified once stored: callers keep it
	members  int
	lastRead time.Time // the last successful read of the members
	degraded bool      // Redis unread for a TTL: every partition
}

func newOutboxShare(rdb *redis.Client, instanceID string, ttl, call time.Duration, log *logrus.Entry) *outboxShare {
	return &outboxShare{rdb: rdb, instanceID: instanceID, ttl: ttl, call: call, log: log}
}

// joinScript adds or refreshes a member with the expiry of this beat (Redis's
// clock, like the heartbeats), forgets the expired ones and, when the member
// is new, tells the others to take their new share.
var joinScript = redis.NewScript(`
local now = redis.call("TIME")
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
redis.call("ZREMRANGEBYSCORE", KEYS[1], "-inf", ms)
if redis.call("ZADD", KEYS[1], ms + tonumber(ARGV[2]), ARGV[1]) == 1 then
	redis.call("PUBLISH", KEYS[2], ARGV[1])
end
return 0`)

// leaveScript removes a member and tells the others.
var leaveScript = redis.NewScript(`
redis.call("ZREM", KEYS[1], ARGV[1])
redis.call("PUBLISH", KEYS[2], ARGV[1])
return 0`)

// membersScript lists the members whose entry has not expired.
var membersScript = redis.NewScript(`
local now = redis.call("TIME")
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
return redis.call("ZRANGEBYSCORE", KEYS[1], ms, "+inf")`)

// join adds or refreshes this poller's entry: at start and with every beat.
func (s *outboxShare) join(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.call)
	defer cancel()
	keys := []string{outboxPollersKey, outboxRebalanceChannel}
	if err := joinScript.Run(ctx, s.rdb, keys, s.instanceID, s.ttl.Milliseconds()).Err(); err != nil {
		return fmt.Errorf("joining the outbox pollers: %w", err)
	}
	return nil
}

// leave removes this poller's entry once its last batch is in: the others
// take its partitions at once instead of after the TTL.
func (s *outboxShare) leave(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.call)
	defer cancel()
	if err := leaveScript.Run(ctx, s.rdb, []string{outboxPollersKey, outboxRebalanceChannel}, s.instanceID).Err(); err != nil {
		return fmt.Errorf("leaving the outbox pollers: %w", err)
	}
	return nil
}

// refresh reads the members and recomputes the share. It reports whether
// the share gained partitions (they may hold a backlog: deliver now). After
// a TTL without a successful read the share is every partition.
func (s *outboxShare) refresh(ctx context.Context) (grew bool, err error) {
	rctx, cancel := context.WithTimeout(ctx, s.call)
	members, err := membersScript.Run(rctx, s.rdb, []string{outboxPollersKey}).StringSlice()
	cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.parts
	if err != nil {
		err = fmt.Errorf("reading the outbox pollers: %w", err)
		if !s.degraded && time.Since(s.lastRead) > s.ttl {
			s.degraded, s.parts = true, shareOf(s.instanceID, nil, true)
			s.log.WithError(err).Warn("outbox pollers unknown for a heartbeat TTL: delivering every partition (the partition locks keep it safe)")
		}
		return len(s.parts) > len(old), err
	}
	if s.degraded {
		s.log.Info("outbox pollers known again: delivering this instance's share")
	}
	s.degraded, s.lastRead = false, time.Now()
	s.parts = shareOf(s.instanceID, members, false)
	if n := max(len(members), 1); n != s.members || !slices.Equal(old, s.parts) {
		s.members = n
		s.log.WithFields(logrus.Fields{"partitions": len(s.parts), "pollers": n}).Info("outbox share")
	}
	return len(s.parts) > len(old), nil
}

// current is the share now; callers must not modify it.
func (s *outboxShare) current() []int32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.parts
}

// shareOf is the partitions of self among members (self counts even when its
// own entry is missing: it delivers until it stops); all: every partition.
func shareOf(self string, members []string, all bool) []int32 {
	members = slices.Clone(members) // sorted here: the caller's order is its own
	if !slices.Contains(members, self) {
		members = append(members, self)
	}
	slices.Sort(members)
	i, n := slices.Index(members, self), len(members)
	if all {
		i, n = 0, 1
	}
	var parts []int32
	for p := i; p < outboxPartitions; p += n {
		parts = append(parts, int32(p))
	}
	return parts
}

// watch keeps the share current until ctx ends: at once when a poller joins
// or leaves, and every interval (a member that died leaves no message, only
// an entry that expires). wake is called when the share grew.
func (s *outboxShare) watch(ctx context.Context, every time.Duration, wake func()) {
	sub := s.rdb.Subscribe(ctx, outboxRebalanceChannel) // go-redis resubscribes after an outage
	defer sub.Close()
	changes := sub.Channel()
	tick := time.NewTicker(every)
	defer tick.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-changes:
		case <-tick.C:
		}
		grew, err := s.refresh(ctx)
		switch {
		case err != nil && ctx.Err() == nil && !failing: // once per outage
			s.log.WithError(err).Warn("cannot read the outbox pollers; keeping the last share")
			failing = true
		case err == nil:
			failing = false
		}
		if grew {
			wake()
		}
	}
}
