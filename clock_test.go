package main

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// Ages and expiries shared across instances are Redis's clock (TIME), never
// one host's wall clock against another's: a heartbeat's value and age, and
// the dashboard index that every writer prunes (issue 20: a writer 5 s ahead
// pruned the others' records).
func TestClusterTimesAreRedisTime(t *testing.T) {
	opts, _ := redis.ParseURL(testRedis(t).URL)
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	ctx := context.Background()
	serverNow := func() time.Time {
		now, err := rdb.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		return now
	}

	m := newMetrics()
	blocks := newBlockMetrics(m)
	hs := newHeartbeats(rdb, "inst-1", 10*time.Second, time.Second, blocks.heartbeat, testReadiness(t, readyLifecycle(t), m, time.Second, time.Hour))
	hb := hs.RegisterHeartbeat(componentOutboxPoller)
	if err := hb.beat(ctx); err != nil {
		t.Fatal(err)
	}
	raw, _ := rdb.Get(ctx, heartbeatKeyPrefix+"outbox:inst-1").Result()
	if ts, err := strconv.ParseInt(raw, 10, 64); err != nil || serverNow().Unix()-ts > 1 || ts > serverNow().Unix() {
		t.Fatalf("heartbeat value %q, want Redis's TIME (%d)", raw, serverNow().Unix())
	}
	// Another instance's beat, 7 s old on Redis's clock, is 7 s old here too.
	rdb.Set(ctx, heartbeatKeyPrefix+"jobs:inst-2", serverNow().Unix()-7, 10*time.Second)
	workers, err := listLiveWorkers(ctx, rdb)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range workers {
		if w.InstanceID == "inst-2" && (w.AgeSec < 7 || w.AgeSec > 8) {
			t.Errorf("inst-2's beat, 7 s old on Redis's clock, has age %d s", w.AgeSec)
		}
	}
	if age, ok := hb.age(); !ok || age < 0 || age > time.Second {
		t.Errorf("own heartbeat age right after a beat = %s, %v", age, ok)
	}

	// The dashboard index: another writer's live entry stays, an expired one
	// goes, ours expires a TTL from Redis's now.
	now := serverNow().UnixMilli()
	rdb.ZAdd(ctx, statusIndexKey, redis.Z{Score: float64(now + 3000), Member: "inst-live"}, redis.Z{Score: float64(now - 1000), Member: "inst-gone"})
	sp := newStatusPublisher(rdb, "inst-1", readyLifecycle(t), blocks.statusFigures(m.httpRequests), logrus.New(), func(component, any) {})
	if err := sp.write(ctx, "ready", 5*time.Second); err != nil {
		t.Fatal(err)
	}
	scores := map[string]float64{}
	zs, _ := rdb.ZRangeWithScores(ctx, statusIndexKey, 0, -1).Result()
	for _, z := range zs {
		scores[z.Member.(string)] = z.Score
	}
	if _, ok := scores["inst-live"]; !ok {
		t.Errorf("a live entry of another instance was pruned: %v", scores)
	}
	if _, ok := scores["inst-gone"]; ok {
		t.Errorf("an expired entry was kept: %v", scores)
	}
	if got := scores["inst-1"] - float64(now); got < 5000 || got > 6000 {
		t.Errorf("own entry expires %.0f ms after Redis's now, want 5000", got)
	}
}
