package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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

// BenchmarkFlightRecorderCost measures what the flight recorder costs the
// order path (KUMIKO_FLIGHT_RECORDER, diagnostics.go); both arms label every
// request (BenchmarkLabelRequests measures that alone): KUMIKO_BENCH_PAIRS (10)
// pairs, each of two fresh instances, one with the recorder and one
// without, on a database of its own each and the same Redis, loaded in turn
// by the same closed-loop clients (KUMIKO_BENCH_WORKERS, 16) for
// KUMIKO_BENCH_SECONDS (5) each. Which one starts first (and so leads) and
// which one is loaded first alternates from pair to pair: an instance's
// place alone was seen to make ±8 % of CPU per order. With
// KUMIKO_BENCH_TOGETHER=1 the two of a pair are loaded at the same time,
// each by its own clients, so that whatever else loads the machine weighs
// on both alike at every instant. Reported: the medians of orders/s and of
// the instance's CPU time per order (utime + stime from /proc), their
// difference in percent, the median of the pairs' own differences
// (pair-…-cost-%), each pair's figures (on stderr), the peak RSS of the
// last pair's instances, and the recorder's window after 10 s more of load
// (an on-demand snapshot's size): what it holds in memory at that rate.
//
//	go test -run '^$' -bench FlightRecorderCost -benchtime 1x .
func BenchmarkFlightRecorderCost(b *testing.B) {
	pairs, seconds, workers := benchKnob(b, "KUMIKO_BENCH_PAIRS", 10), benchKnob(b, "KUMIKO_BENCH_SECONDS", 5), benchKnob(b, "KUMIKO_BENCH_WORKERS", 16)
	together := os.Getenv("KUMIKO_BENCH_TOGETHER") == "1"
	type instance struct {
		p        *proc
		ops, api string
	}
	type arm struct {
		recorder  bool
		perSecond []float64
		cpuMicros []float64
		last      instance
	}
	on, off := &arm{recorder: true}, &arm{recorder: false}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 2 * workers}}
	load := func(api string, d time.Duration) (orders int64) {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		var n atomic.Int64
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for ctx.Err() == nil {
					resp, err := client.Post(api+"/api/orders", "application/json", strings.NewReader(validOrder))
					if err != nil {
						continue
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode == http.StatusCreated && ctx.Err() == nil {
						n.Add(1)
					}
				}
			})
		}
		wg.Wait()
		return n.Load()
	}
	cpu := func(p *proc) time.Duration {
		f := procStat(p.cmd.Process.Pid)
		utime, _ := strconv.ParseInt(f[14-3], 10, 64)
		stime, _ := strconv.ParseInt(f[15-3], 10, 64)
		return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
	}
	d := time.Duration(seconds) * time.Second
	measure := func(a *arm, in instance) {
		before, start := cpu(in.p), time.Now()
		n := load(in.api, d)
		took, used := time.Since(start), cpu(in.p)-before
		a.perSecond = append(a.perSecond, float64(n)/took.Seconds())
		a.cpuMicros = append(a.cpuMicros, float64(used.Microseconds())/float64(n))
	}
	b.ResetTimer()
	for pair := range pairs {
		order := []*arm{on, off}
		if pair%2 == 1 {
			order[0], order[1] = order[1], order[0]
		}
		// Production's cadence for the background loops, so they weigh as they would.
		for _, a := range order {
			env := fastEnv(b, fmt.Sprintf("KUMIKO_FLIGHT_RECORDER=%t", a.recorder), "KUMIKO_API_RATE_LIMIT=0",
				"KUMIKO_ADMIN_TOKEN="+testAdminToken, "KUMIKO_READINESS_CHECK_INTERVAL=1s", "KUMIKO_OUTBOX_POLL_INTERVAL=1s",
				fmt.Sprintf("KUMIKO_INSTANCE_ID=bench-%d-recorder-%t", pair, a.recorder))
			p := startProc(b, env)
			ops, api := p.waitReady()
			a.last = instance{p: p, ops: ops, api: api}
		}
		for _, a := range order {
			load(a.last.api, time.Second) // warm-up: pools filled, code paged in
		}
		if together {
			var wg sync.WaitGroup
			for _, a := range order {
				wg.Go(func() { measure(a, a.last) })
			}
			wg.Wait()
		} else {
			for _, a := range order {
				measure(a, a.last)
			}
		}
		if pair < pairs-1 {
			for _, a := range order {
				a.last.p.signal(syscall.SIGTERM)
				a.last.p.wait(30 * time.Second)
			}
		}
	}
	b.StopTimer()
	var throughputCost, cpuCost []float64
	var table strings.Builder
	table.WriteString("pair  on orders/s  off orders/s  on µs/order  off µs/order\n")
	for i := range pairs {
		throughputCost = append(throughputCost, 100*(off.perSecond[i]-on.perSecond[i])/off.perSecond[i])
		cpuCost = append(cpuCost, 100*(on.cpuMicros[i]-off.cpuMicros[i])/off.cpuMicros[i])
		fmt.Fprintf(&table, "%4d  %12.0f  %12.0f  %11.0f  %12.0f\n", i+1, on.perSecond[i], off.perSecond[i], on.cpuMicros[i], off.cpuMicros[i])
	}
	fmt.Fprint(os.Stderr, table.String()) // b.Log would cut it short
	median := func(s []float64) float64 {
		s = slices.Clone(s)
		slices.Sort(s)
		if len(s)%2 == 0 {
			return (s[len(s)/2-1] + s[len(s)/2]) / 2
		}
		return s[len(s)/2]
	}
	b.ReportMetric(median(on.perSecond), "on-orders/s")
	b.ReportMetric(median(off.perSecond), "off-orders/s")
	b.ReportMetric(100*(median(off.perSecond)-median(on.perSecond))/median(off.perSecond), "throughput-cost-%")
	b.ReportMetric(median(throughputCost), "pair-throughput-cost-%")
	b.ReportMetric(median(on.cpuMicros), "on-cpu-µs/order")
	b.ReportMetric(median(off.cpuMicros), "off-cpu-µs/order")
	b.ReportMetric(100*(median(on.cpuMicros)-median(off.cpuMicros))/median(off.cpuMicros), "cpu-cost-%")
	b.ReportMetric(median(cpuCost), "pair-cpu-cost-%")
	for name, a := range map[string]*arm{"on": on, "off": off} {
		b.ReportMetric(float64(peakRSS(b, a.last.p.cmd.Process.Pid))/(1<<20), name+"-peak-rss-MiB")
	}
	load(on.last.api, 10*time.Second)
	req := must(http.NewRequest(http.MethodPost, on.last.ops+"/admin/diagnostics", nil))
	req.Header.Set("Authorization", "Bearer "+testAdminToken)
	resp, body := roundTrip(b, nil, req)
	var files map[string]string
	if resp.StatusCode != http.StatusCreated || json.Unmarshal(body, &files) != nil {
		b.Fatalf("snapshot: %d %s", resp.StatusCode, body)
	}
	resp, body = getBody(b, on.last.ops+"/admin/diagnostics/"+files["trace"], "Bearer "+testAdminToken)
	if resp.StatusCode != http.StatusOK {
		b.Fatalf("download: %d", resp.StatusCode)
	}
	b.ReportMetric(float64(len(body))/(1<<20), "window-MiB")
}

// benchKnob is an integer setting of a benchmark from the environment.
func benchKnob(b *testing.B, name string, def int) int {
	if v := os.Getenv(name); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			b.Fatalf("%s=%q: want a positive integer", name, v)
		}
		return n
	}
	return def
}

// peakRSS is a process's peak resident memory (VmHWM), in bytes.
func peakRSS(b *testing.B, pid int) int64 {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.SplitSeq(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}
