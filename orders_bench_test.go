package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func BenchmarkRateLimiterCostOnCreateOrder(b *testing.B) {
	on, off := fastEnv(b), fastEnv(b)
	// High enough that no request is refused: the check itself is measured.
	on["KUMIKO_API_RATE_LIMIT"], on["KUMIKO_API_RATE_BURST"] = "1000000", "1000000"
	off["KUMIKO_API_RATE_LIMIT"] = "0"
	urls := []string{apiURL(startInProcess(b, on)) + "/api/orders", apiURL(startInProcess(b, off)) + "/api/orders"}
	client := &http.Client{Timeout: 5 * time.Second}
	samples := [2][]time.Duration{}
	postOnce := func(i int) {
		req, _ := http.NewRequest(http.MethodPost, urls[i], strings.NewReader(validOrder))
		req.Header.Set("Content-Type", "application/json")
		start := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			b.Fatalf("POST: %d", resp.StatusCode)
		}
		samples[i] = append(samples[i], time.Since(start))
	}
	b.ResetTimer()
	for n := range b.N {
		// Alternate which goes first, so neither always gets the warmer cache.
		postOnce(n % 2)
		postOnce(1 - n%2)
	}
	b.StopTimer()
	p50 := func(s []time.Duration) float64 {
		slices.Sort(s)
		return float64(s[len(s)/2].Microseconds()) / 1000
	}
	pOn, pOff := p50(samples[0]), p50(samples[1])
	b.ReportMetric(pOn, "limiter-on-p50-ms")
	b.ReportMetric(pOff, "limiter-off-p50-ms")
	b.ReportMetric(100*(pOn-pOff)/pOff, "cost-%")
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

// BenchmarkTracingOverhead compares boot time and POST /api/orders latency
// with traces exported to a real OTLP/HTTP receiver and with the noop provider.
//
//	go test -run '^$' -bench TracingOverhead -benchtime 200x .
func BenchmarkTracingOverhead(b *testing.B) {
	for _, mode := range []string{"off", "on"} {
		b.Run("tracing="+mode, func(b *testing.B) {
			env, ops := benchEnv(b)
			if mode == "on" {
				env["OTEL_EXPORTER_OTLP_ENDPOINT"] = newOTLPReceiver(b).srv.URL
			}
			var boots []time.Duration
			for range 5 {
				boots = append(boots, timeBoot(b, env, ops))
			}

			cmd := benchCmd(env)
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			defer func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() }()
			waitReady200(b, ops)
			api := "http://" + env["KUMIKO_HTTP_ADDR"] + "/api/orders"
			var lat []time.Duration
			for b.Loop() {
				start := time.Now()
				resp, err := http.Post(api, "application/json", strings.NewReader(validOrder))
				if err != nil || resp.StatusCode != 201 {
					b.Fatalf("POST: %v %v", err, resp)
				}
				resp.Body.Close()
				lat = append(lat, time.Since(start))
			}
			reportMedian(b, "post", lat)
			reportMedian(b, "boot", boots) // after the loop: b.Loop's timer reset clears reported metrics
		})
	}
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
			created[a.orderID()] = true
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
		poll(20*time.Second-time.Since(frozen), 10*time.Millisecond, func() bool {
			if a := do(client, must(http.NewRequest(http.MethodGet, ops+"/health/ready", nil))); a.status == http.StatusServiceUnavailable {
				flip = time.Since(frozen)
				return true
			}
			return false
		})
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
