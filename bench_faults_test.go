package main

// Figures for the fault paths, measured, not asserted:
//
//	go test -run '^$' -bench 'OutboxRedis' -benchtime 20000x .
//
// BenchmarkOutboxRedis/redis=up|down   delivered events/s from a backlog
//                                      committed at once, with Redis up, and
//                                      with Redis stopped (the SSE hubs then
//                                      catch up from Postgres on their poll)
// demo:begin (the orders demo's benchmark, in orders_bench_test.go; scripts/new-service.sh --bare removes this block)
//
//	go test -run '^$' -bench DependencyBlips -benchtime 1x -v .
//
// BenchmarkDependencyBlips prints, for the service binary as a child
// process (KUMIKO_BENCH_BINARY runs another build, e.g. an older release,
// for a before/after): a 20 s load of 200 orders/s across a fast PostgreSQL
// restart (requests, answers by status, p99, orders lost and doubled), and
// with Redis and then PostgreSQL frozen (SIGSTOP): POST p50/p99 with and
// without an Idempotency-Key, the readiness flip and SIGTERM → exit.
// demo:end

import (
	"context"
	"slices"
	"testing"
	"time"
)

func BenchmarkOutboxRedis(b *testing.B) {
	for _, state := range []string{"up", "down"} {
		b.Run("redis="+state, func(b *testing.B) {
			f := newOutboxFixture(b)
			f.cfg = outboxConfig{BatchSize: 100, PollInterval: 50 * time.Millisecond, Listen: true, MaxAttempts: 10, RetryBase: time.Second, RetryMax: time.Minute}
			// The poller checks Redis when it starts; the outage begins after.
			if err := f.poller(b, "p").Start(context.Background()); err != nil {
				b.Fatal(err)
			}
			if state == "down" {
				f.redis.Stop()
			}
			f.writeEvents(b, b.N) // one transaction: the backlog appears at once
			b.ResetTimer()
			start := time.Now()
			f.waitDelivered(b, b.N, 5*time.Minute)
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "events/s")
		})
	}
}

func percentile(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)].Round(time.Millisecond)
}
