// Command overload is the load and the count of scripts/bench-overload.sh:
// POST /api/orders, each with an Idempotency-Key of its own, and afterwards
// the orders PostgreSQL holds for those keys, compared with what each client
// was told. vegeta cannot say which request got which answer; this can.
//
//	overload -url http://127.0.0.1:18091 -workers 32 -duration 10s            # closed loop: the peak rate
//	overload -url … -rate 4500 -duration 10s -pid 1234                         # open loop, RSS of 1234 sampled
//	overload -url … -rate 3000 -duration 8s -kill 1234 -kill-after 3s          # SIGKILL 1234 mid-load
//	overload -refuse 127.0.0.1:18097                                           # the floor: see refuse
//
// It prints one line of key=value figures (goodput is 201 answers per
// second; p99 of the 201s and of the 503s; RSS at most) and, with
// DATABASE_URL set, the orders stored for its keys against the answers:
// stored ⊆ 201 ∪ in flight (written, no answer: the instance was killed or
// the client stopped waiting), and every 201 stored. It exits 1 when that
// does not hold.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/kumiko/kumiko-lifecycle-demo/scripts/internal/loadtool"
)

const body = `{"customer":"Ada Lovelace","items":[{"sku":"tea","qty":2,"priceCents":250},{"sku":"cake","qty":1,"priceCents":400}]}`

// outcome is what one request's client learned.
type outcome struct {
	key     string
	status  int           // 0: no answer
	code    string        // a 503's error code: "overloaded" is the limit's, others came after admission
	sent    bool          // written to a connection (no answer then: in flight when it broke)
	latency time.Duration // request sent → answer read
}

func main() {
	url := flag.String("url", "", "the service's API base URL")
	workers := flag.Int("workers", 0, "closed loop: this many clients at full speed")
	rate := flag.Int("rate", 0, "open loop: requests per second, whatever the answers")
	duration := flag.Duration("duration", 10*time.Second, "how long to send")
	pid := flag.Int("pid", 0, "sample this process's RSS while sending")
	metricsURL := flag.String("metrics", "", "sample the concurrency limit from this /metrics while sending")
	kill := flag.Int("kill", 0, "SIGKILL this process after -kill-after")
	killAfter := flag.Duration("kill-after", 3*time.Second, "")
	prefix := flag.String("prefix", "bench-"+strconv.FormatInt(time.Now().UnixNano(), 36), "Idempotency-Key prefix of this run")
	refuseAddr := flag.String("refuse", "", "serve on this address: every request answered 503 by bare net/http, until SIGTERM")
	flag.Parse()
	if *refuseAddr != "" {
		if err := refuse(*refuseAddr); err != nil {
			fmt.Fprintln(os.Stderr, "overload:", err)
			os.Exit(1)
		}
		return
	}
	if *url == "" || (*workers == 0) == (*rate == 0) {
		fmt.Fprintln(os.Stderr, "overload: -url and one of -workers or -rate")
		os.Exit(2)
	}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		MaxIdleConns: 100_000, MaxIdleConnsPerHost: 100_000, IdleConnTimeout: 30 * time.Second}}
	var (
		mu       sync.Mutex
		outcomes []outcome
		n        int
		killedAt time.Time
	)
	next := func() string {
		mu.Lock()
		defer mu.Unlock()
		n++
		return *prefix + "-" + strconv.Itoa(n)
	}
	send := func(key string) {
		o := outcome{key: key}
		// Written is what makes a request in flight. net/http sends a request
		// with an Idempotency-Key again on a new connection when the first
		// broke, so an attempt refused after it does not mean it never arrived.
		var wrote atomic.Bool
		trace := &httptrace.ClientTrace{WroteRequest: func(httptrace.WroteRequestInfo) { wrote.Store(true) }}
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace),
			http.MethodPost, *url+"/api/orders", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		start := time.Now()
		res, err := client.Do(req)
		if err == nil {
			var raw []byte
			raw, err = io.ReadAll(io.LimitReader(res.Body, 4096))
			res.Body.Close()
			if err == nil {
				o.status = res.StatusCode
			}
			if o.status == http.StatusServiceUnavailable {
				var e struct {
					Error struct{ Code string } `json:"error"`
				}
				json.Unmarshal(raw, &e)
				o.code = e.Error.Code
			}
		}
		o.latency, o.sent = time.Since(start), wrote.Load()
		mu.Lock()
		outcomes = append(outcomes, o)
		mu.Unlock()
	}

	rss := &rssSampler{pid: *pid}
	stop := rss.start()
	limits := sampleLimit(*metricsURL)
	if *kill != 0 {
		time.AfterFunc(*killAfter, func() {
			mu.Lock()
			killedAt = time.Now()
			mu.Unlock()
			syscall.Kill(*kill, syscall.SIGKILL)
		})
	}
	start := time.Now()
	end := start.Add(*duration)
	var wg sync.WaitGroup
	if *workers > 0 {
		for range *workers {
			wg.Go(func() {
				for time.Now().Before(end) {
					send(next())
				}
			})
		}
	} else {
		interval := time.Second / time.Duration(*rate)
		for i := 0; ; i++ {
			at := start.Add(time.Duration(i) * interval)
			if !at.Before(end) {
				break
			}
			if d := time.Until(at); d > 0 {
				time.Sleep(d)
			}
			key := next()
			wg.Go(func() { send(key) })
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	maxRSS := stop()
	limit := limits()
	// The tool's own CPU, in cores: at 1 (its core, when the benchmark pins
	// it) it sends late and reads answers late, and the figures are its own.
	loadCPU := cpuTime().Seconds() / elapsed.Seconds()

	var created, shed, other, noAnswer, refused []outcome
	for _, o := range outcomes {
		switch {
		case o.status == http.StatusCreated:
			created = append(created, o)
		case o.status == http.StatusServiceUnavailable:
			shed = append(shed, o)
		case o.status != 0:
			other = append(other, o)
		case o.sent:
			noAnswer = append(noAnswer, o)
		default:
			refused = append(refused, o)
		}
	}
	sendSeconds := min(elapsed, *duration).Seconds()
	fmt.Printf("sent=%d rate=%.0f/s goodput=%.0f/s created=%d shed=%d other=%d no_answer=%d refused=%d "+
		"p50_created_ms=%.1f p99_created_ms=%.1f p50_shed_ms=%.1f p99_shed_ms=%.1f max_rss_mb=%.0f load_cpu=%.2f\n",
		len(outcomes), float64(len(outcomes))/sendSeconds, float64(len(created))/sendSeconds, len(created), len(shed), len(other), len(noAnswer), len(refused),
		ms(quantile(created, 0.5)), ms(quantile(created, 0.99)), ms(quantile(shed, 0.5)), ms(quantile(shed, 0.99)), float64(maxRSS)/(1<<20), loadCPU)
	if len(other) > 0 {
		fmt.Printf("other statuses: %s\n", statuses(other))
	}
	if len(limit) > 0 {
		slices.Sort(limit)
		fmt.Printf("limit_p10=%.0f limit_p50=%.0f limit_p90=%.0f (the concurrency limit, sampled every 100 ms)\n",
			limit[len(limit)/10], limit[len(limit)/2], limit[len(limit)*9/10])
	}
	// The limit's 503s are refused at the door; the others were admitted and
	// ran out of their budget on the way (waiting for the database).
	var overloaded, late []outcome
	for _, o := range shed {
		if o.code == "overloaded" {
			overloaded = append(overloaded, o)
		} else {
			late = append(late, o)
		}
	}
	fmt.Printf("shed_by_limit=%d p99_limit_ms=%.1f shed_after_admission=%d p99_after_admission_ms=%.1f\n",
		len(overloaded), ms(quantile(overloaded, 0.99)), len(late), ms(quantile(late, 0.99)))

	if os.Getenv("DATABASE_URL") == "" {
		return
	}
	stored, err := storedKeys(os.Getenv("DATABASE_URL"), *prefix)
	if err != nil {
		fmt.Fprintln(os.Stderr, "overload: reading the stored orders:", err)
		os.Exit(2)
	}
	told := func(list []outcome) (inStore int) {
		for _, o := range list {
			if stored[o.key] {
				inStore++
			}
		}
		return inStore
	}
	createdStored, shedStored, otherStored, inFlightStored, refusedStored := told(created), told(shed), told(other), told(noAnswer), told(refused)
	fmt.Printf("stored=%d created=%d created_stored=%d shed_stored=%d other_stored=%d in_flight=%d in_flight_stored=%d refused_stored=%d\n",
		len(stored), len(created), createdStored, shedStored, otherStored, len(noAnswer), inFlightStored, refusedStored)
	// In flight: written, and no answer came: the instance was killed, or
	// the client stopped waiting (10 s). Either may have been stored: its
	// client finds out with its key.
	ok := createdStored == len(created) && shedStored+otherStored+refusedStored == 0
	if !killedAt.IsZero() {
		fmt.Printf("killed after %s: ", killedAt.Sub(start).Round(time.Millisecond))
	}
	fmt.Printf("stored ⊆ 201 ∪ in flight: %t; every 201 stored: %t; %d of %d in flight stored, each found by its key\n",
		shedStored+otherStored+refusedStored == 0, createdStored == len(created), inFlightStored, len(noAnswer))
	if !ok {
		fmt.Println("FAILED: an order is stored whose client was told otherwise, or a 201 is not stored")
		os.Exit(1)
	}
}

// storedKeys is the Idempotency-Keys with prefix that have an order.
func storedKeys(url, prefix string) (map[string]bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT idempotency_key FROM orders WHERE idempotency_key LIKE $1 || '-%'`, prefix)
	if err != nil {
		return nil, err
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	stored := make(map[string]bool, len(keys))
	for _, k := range keys {
		stored[k] = true
	}
	return stored, err
}

func quantile(list []outcome, q float64) time.Duration {
	if len(list) == 0 {
		return 0
	}
	ds := make([]time.Duration, len(list))
	for i, o := range list {
		ds[i] = o.latency
	}
	slices.Sort(ds)
	return ds[min(len(ds)-1, int(q*float64(len(ds))))]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// cpuTime is the CPU this process has used, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func statuses(list []outcome) string {
	count := map[int]int{}
	for _, o := range list {
		count[o.status]++
	}
	var b strings.Builder
	for s, c := range count {
		fmt.Fprintf(&b, "%d×%d ", s, c)
	}
	return strings.TrimSpace(b.String())
}

// sampleLimit reads the instance's concurrency limit from its /metrics every
// 100 ms until the returned function is called, which returns the samples.
func sampleLimit(url string) (stop func() []float64) {
	if url == "" {
		return func() []float64 { return nil }
	}
	var samples []float64
	client := &http.Client{Timeout: time.Second}
	end := every(100*time.Millisecond, func() {
		res, err := client.Get(url)
		if err != nil {
			return
		}
		raw, _ := io.ReadAll(res.Body)
		res.Body.Close()
		for line := range strings.Lines(string(raw)) {
			// The metric's namespace is the service's name: match its suffix.
			if name, value, ok := strings.Cut(strings.TrimSpace(line), " "); ok && strings.HasSuffix(name, "_api_concurrency_limit") {
				if v, err := strconv.ParseFloat(value, 64); err == nil {
					samples = append(samples, v)
				}
			}
		}
	})
	return func() []float64 {
		end()
		return samples
	}
}

// rssSampler reads a process's resident set every 100 ms and keeps the most.
type rssSampler struct {
	pid  int
	most int64
}

func (r *rssSampler) start() (stop func() int64) {
	if r.pid == 0 {
		return func() int64 { return 0 }
	}
	end := every(100*time.Millisecond, func() { r.most = max(r.most, loadtool.RSS(r.pid)) })
	return func() int64 {
		end()
		return max(r.most, loadtool.RSS(r.pid))
	}
}

// every runs fn at once and then every interval, on a goroutine of its own,
// until stop is called; stop returns once fn has run for the last time.
func every(interval time.Duration, fn func()) (stop func()) {
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			fn()
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}

// refuse answers every request on addr with the instance's 503, using
// net/http and nothing else: no router, middleware, metrics or limit. The
// CPU it spends per request is the floor of what any Go service pays to
// refuse one on this machine (reading the request, writing the answer, the
// runtime's scheduling), against which the instance's own refusal is
// measured.
func refuse(addr string) error {
	answer := []byte(`{"error":{"code":"overloaded","message":"this instance is at its capacity; retry shortly"}}` + "\n")
	srv := &http.Server{Addr: addr, ReadHeaderTimeout: 5 * time.Second, IdleTimeout: time.Minute,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusServiceUnavailable)
			w.Write(answer)
		})}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serving refusals on %s: %w", addr, err)
	}
	return nil
}
