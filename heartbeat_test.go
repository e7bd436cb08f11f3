package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
)

// A heartbeat handle is registered, updated, goes stale, and is cleared at shutdown.
func TestHeartbeatLifecycle(t *testing.T) {
	srv := testRedis(t)
	opts, _ := redis.ParseURL(srv.URL)
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	ctx := context.Background()

	lc := readyLifecycle(t)
	m := newMetrics()
	rd := testReadiness(t, lc, m, time.Second, time.Hour)
	hs := newHeartbeats(rdb, "inst-1", 300*time.Millisecond, time.Second, newHeartbeatMetrics(m.registry, blockComponents()), rd)
	hb := hs.RegisterHeartbeat(componentOutboxPoller)

	rd.refresh(ctx)
	if rep, ok := rd.report(); ok || rep.Checks["outboxPoller"].OK {
		t.Fatalf("ready before the first beat: %+v", rep.Checks)
	}
	if err := hb.beat(ctx); err != nil {
		t.Fatal(err)
	}
	ttl, err := rdb.PTTL(ctx, heartbeatKeyPrefix+"outbox:inst-1").Result()
	if err != nil || ttl <= 0 || ttl > 300*time.Millisecond {
		t.Fatalf("heartbeat key TTL %v (%v), want ≤ 300ms", ttl, err)
	}
	rd.refresh(ctx)
	if _, ok := rd.report(); !ok {
		t.Fatal("not ready right after a beat")
	}
	workers, err := listLiveWorkers(ctx, rdb)
	if err != nil || len(workers) != 1 || workers[0].Worker != "outbox" || workers[0].InstanceID != "inst-1" {
		t.Fatalf("live workers %+v, %v", workers, err)
	}
	if err := testutil.CollectAndCompare(heartbeatAgeCollector{hs}, strings.NewReader(""), "kumiko_worker_heartbeat_age_seconds"); err == nil {
		t.Fatal("age metric missing") // compare against empty must fail when the metric exists
	}

	// The worker "hangs": no beat within the TTL. Beats are measured from
	// born, so moving it back ages them the way 350 ms of silence would.
	hs.born = hs.born.Add(-350 * time.Millisecond)
	rd.refresh(ctx)
	if rep, ok := rd.report(); ok || !strings.Contains(rep.Checks["outboxPoller"].Detail["error"].(string), "stale") {
		t.Fatalf("a stale heartbeat kept the instance ready: %+v", rep.Checks["outboxPoller"])
	}

	if err := hb.beat(ctx); err != nil {
		t.Fatal(err)
	}
	if err := hs.clear(ctx); err != nil {
		t.Fatal(err)
	}
	if n, _ := rdb.Exists(ctx, heartbeatKeyPrefix+"outbox:inst-1").Result(); n != 0 {
		t.Fatal("heartbeat key still there after a clean stop")
	}
}

// A worker that beats while Redis does not answer is alive: its check is
// degraded (Redis is every instance's) and the instance stays ready; a worker
// that stopped beating fails readiness.
func TestHeartbeatWithoutRedisIsDegradedNotStale(t *testing.T) {
	t.Parallel()
	srv := testRedis(t)
	rdb := redisClient(t, srv.URL)
	ctx := context.Background()
	m := newMetrics()
	rd := testReadiness(t, readyLifecycle(t), m, time.Second, time.Hour)
	hs := newHeartbeats(rdb, "inst-1", time.Minute, 100*time.Millisecond, newHeartbeatMetrics(m.registry, blockComponents()), rd)
	hs.born = time.Now().Add(-time.Hour) // the last beat that reached Redis was an hour ago
	hb := hs.RegisterHeartbeat(componentOutboxPoller)
	hb.last.Store(1)
	hb.tried.Store(1)

	rd.refresh(ctx)
	if rep, ok := rd.report(); ok || !strings.Contains(rep.Checks["outboxPoller"].Detail["error"].(string), "stuck") {
		t.Fatalf("a worker that stopped beating an hour ago: ready=%v %+v", ok, rep.Checks["outboxPoller"])
	}

	srv.Pause()
	defer srv.Resume()
	if err := hb.beat(ctx); err == nil {
		t.Fatal("a beat reached a frozen Redis")
	}
	rd.refresh(ctx)
	rep, ok := rd.report()
	if !ok || rep.Checks["outboxPoller"].OK || strings.Join(rep.Degraded, ",") != "outboxPoller" {
		t.Fatalf("a worker that beats while Redis is frozen: ready=%v degraded=%v %+v", ok, rep.Degraded, rep.Checks["outboxPoller"])
	}
}
