package main

// Figures for the fault paths, measured, not asserted:
//
//	go test -run '^$' -bench 'OutboxRedis' -benchtime 20000x .
//
// BenchmarkOutboxRedis/redis=up|down   delivered events/s from a backlog
//                                      committed at once, with Redis up, and
//                                      with Redis stopped (the SSE hubs then
//                                      catch up from Postgres on their poll)
//
//	go test -run '^$' -bench DependencyBlips -benchtime 1x -v .
//
// BenchmarkDependencyBlips prints, for the service binary as a child
// process (KUMIKO_BENCH_BINARY runs another build, e.g. an older release,
// for a before/after): a 20 s load of 200 orders/s across a fast PostgreSQL
// restart (requests, answers by status, p99, orders lost and doubled), and
// with Redis and then PostgreSQL frozen (SIGSTOP): POST p50/p99 with and
// without an Idempotency-Key, the readiness flip and SIGTERM → exit.

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

func BenchmarkDependencyBlips(b *testing.B) {
	if bin := os.Getenv("KUMIKO_BENCH_BINARY"); bin != "" {
		defer func(old string) { testBinary = old }(testBinary)
		testBinary = bin
	}
	b.Run("postgres=restart", func(b *testing.B) {
		for range b.N {
			restartUnderLoad(b)
		}
	})
	b.Run("redis=frozen", func(b *testing.B) {
		for range b.N {
			rd := testRedis(b)
			env := fastEnv(b)
			env["REDIS_URL"] = rd.URL
			frozenDependency(b, env, rd.Pause, rd.Resume)
		}
	})
	b.Run("postgres=frozen", func(b *testing.B) {
		for range b.N {
			pg, env := ownPostgresEnv(b)
			frozenDependency(b, env, pg.Freeze, pg.Thaw)
		}
	})
}

// restartUnderLoad posts 200 orders/s for 20 s and restarts PostgreSQL
// after 10 s, then compares the answers with the rows.
func restartUnderLoad(b *testing.B) {
	pg, env := ownPostgresEnv(b)
	p := startProc(b, env)
	p.waitLog(20*time.Second, map[string]any{"event": "state_changed", "to": "ready"})
	api := p.addr("api")
	client := &http.Client{Timeout: 10 * time.Second}
	const rate, seconds = 200, 20
	var mu sync.Mutex
	var answers []answer
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / rate)
	for i := range rate * seconds {
		<-tick.C
		if i == rate*seconds/2 {
			go pg.Restart()
		}
		wg.Go(func() {
			a := postOrder(client, api, "")
			mu.Lock()
			answers = append(answers, a)
			mu.Unlock()
		})
	}
	tick.Stop()
	wg.Wait()
	byStatus := map[string]int{}
	created := map[string]bool{}
	var took []time.Duration
	for _, a := range answers {
		took = append(took, a.took)
		switch {
		case a.err != nil:
			byStatus["no answer"]++
		case a.status == http.StatusServiceUnavailable && a.retryAfter != "":
			byStatus["503+Retry-After"]++
		default:
			byStatus[fmt.Sprint(a.status)]++
		}
		if a.status == http.StatusCreated {
			created[a.id] = true
		}
	}
	conn, err := pgx.Connect(context.Background(), pg.URL)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(context.Background())
	rows, _ := conn.Query(context.Background(), `SELECT public_id::text FROM orders`)
	stored, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		b.Fatal(err)
	}
	unanswered := 0 // stored, but the client was told otherwise: its retry would order twice
	for _, id := range stored {
		if !created[id] {
			unanswered++
		}
		delete(created, id)
	}
	b.Logf("restart under %d orders/s for %d s: %d requests, %v, p50 %s, p99 %s; orders lost (201, not stored): %d, stored but not answered 201: %d",
		rate, seconds, len(answers), byStatus, percentile(took, 50), percentile(took, 99), len(created), unanswered)
}

// frozenDependency freezes a dependency of a ready instance and prints what
// clients and an operator see, then SIGTERMs the instance while it is frozen.
func frozenDependency(b *testing.B, env map[string]string, freeze, thaw func()) {
	env["KUMIKO_SHUTDOWN_TIMEOUT"] = "40s"
	env["KUMIKO_DRAIN_TIMEOUT"] = "30s"
	env["KUMIKO_LINGER"] = "0"
	p := startProc(b, env)
	p.waitLog(20*time.Second, map[string]any{"event": "state_changed", "to": "ready"})
	ops, api := p.addr("ops"), p.addr("api")
	client := &http.Client{Timeout: 15 * time.Second}
	frozen := time.Now()
	freeze()
	defer thaw()
	var flip time.Duration
	flipped := make(chan struct{})
	go func() {
		defer close(flipped)
		for time.Since(frozen) < 20*time.Second {
			if a := do(client, must(http.NewRequest(http.MethodGet, ops+"/health/ready", nil))); a.status == http.StatusServiceUnavailable {
				flip = time.Since(frozen)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	for _, key := range []bool{false, true} {
		answers := concurrently(10, func(i int) answer {
			k := ""
			if key {
				k = fmt.Sprintf("frozen-%d-%d", time.Now().UnixNano(), i)
			}
			return postOrder(client, api, k)
		})
		var took []time.Duration
		byStatus := map[string]int{}
		for _, a := range answers {
			took = append(took, a.took)
			if a.err != nil {
				byStatus["no answer"]++
			} else {
				byStatus[fmt.Sprint(a.status)]++
			}
		}
		b.Logf("POST (Idempotency-Key %t) x10: p50 %s, p99 %s, %v", key, percentile(took, 50), percentile(took, 99), byStatus)
	}
	<-flipped
	b.Logf("readiness 503 after %s", flip.Round(time.Millisecond))
	sent := time.Now()
	p.signal(syscall.SIGTERM)
	code := p.wait(60 * time.Second)
	var steps []string
	for _, l := range p.logsMatching(map[string]any{"msg": "lifecycle"}) {
		if ms, ok := l["duration_ms"].(float64); ok && l["step"] != nil && ms >= 100 {
			steps = append(steps, fmt.Sprintf("%v %.0f ms", l["step"], ms))
		}
	}
	b.Logf("SIGTERM → exit %d in %s; steps of 100 ms or more: %v", code, time.Since(sent).Round(time.Millisecond), steps)
}

func percentile(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)].Round(time.Millisecond)
}
