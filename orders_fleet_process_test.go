package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2/client"
)

// A fault that every instance meets at once — a hung S3 or Meilisearch, a
// frozen or slow Redis — must not empty the load balancer: two instances
// behind a real HAProxy (deploy/haproxy.cfg's checks: every 500 ms, out after
// one failure) take orders at 50/s through each fault, and none fails.
// Readiness stays 200 on both ports all along, listing the dependency under
// degraded, and the leader keeps leading through 300 ms and 1.2 s of Redis latency.
// KUMIKO_FLEET_FAULT (default 4s) sets each fault's length: 8s is the
// operator's trial the issue describes. The figures are printed per fault.
func TestProcessFleetFaultsThroughHAProxy(t *testing.T) {
	t.Parallel()
	haproxy, err := exec.LookPath("haproxy")
	if err != nil {
		if haproxy, err = "/usr/sbin/haproxy", nil; !isExecutable(haproxy) {
			failOrSkip(t, &missingServiceError{what: "haproxy (the load balancer of the fleet test)", install: "scripts/install-deps.sh (apt-get install haproxy)"})
		}
	}
	faultLen := 4 * time.Second
	if v := os.Getenv("KUMIKO_FLEET_FAULT"); v != "" {
		if faultLen, err = time.ParseDuration(v); err != nil {
			t.Fatalf("KUMIKO_FLEET_FAULT: %v", err)
		}
	}

	tp := testToxiproxy(t)
	rsrv := testRedis(t)
	redisProxy := proxyTo(t, tp, "redis", rsrv.Addr)
	s3 := testS3(t)
	s3Proxy := proxyTo(t, tp, "s3", s3.Endpoint)
	meili := newMeiliDouble(t, "available")
	meiliProxy := proxyTo(t, tp, "meili", strings.TrimPrefix(meili.srv.URL, "http://"))

	env := fastEnv(t,
		"REDIS_URL="+withHost(t, rsrv.URL, redisProxy.Listen),
		"S3_ENDPOINT="+s3Proxy.Listen, "S3_ACCESS_KEY="+s3.AccessKey, "S3_SECRET_KEY="+s3.SecretKey,
		"MEILI_URL=http://"+meiliProxy.Listen,
	)
	// A renew deadline of 5 s: a frozen Redis may cost the leadership once,
	// a slow one (every renewal 1.2 s late) must not.
	env["KUMIKO_LEADER_LOCK_TTL"], env["KUMIKO_LEADER_RENEW_INTERVAL"] = "6s", "1s"
	// Heartbeats every 500 ms with a 3 s TTL: a fault of 4 s leaves them
	// unwritten past the TTL, which readiness must show as degraded only.
	env["KUMIKO_HEARTBEAT_INTERVAL"], env["KUMIKO_HEARTBEAT_TTL"] = "500ms", "3s"
	env["KUMIKO_READINESS_CHECK_INTERVAL"], env["KUMIKO_READINESS_PROBE_TIMEOUT"] = "250ms", "500ms"
	env["KUMIKO_API_RATE_LIMIT"] = "0" // every order comes from HAProxy's address
	var apps []*proc
	var opsURLs, apiURLs []string
	for _, name := range []string{"app1", "app2"} {
		e := maps.Clone(env)
		e["KUMIKO_INSTANCE_ID"] = "fleet-" + name
		p := startProc(t, e)
		ops, api := p.waitReady()
		apps, opsURLs, apiURLs = append(apps, p), append(opsURLs, ops), append(apiURLs, api)
	}
	lb := startHAProxy(t, haproxy, apiURLs, opsURLs)
	client := &http.Client{Timeout: 10 * time.Second}
	waitFor(t, 20*time.Second, "HAProxy to send to both instances", func() bool {
		seen := map[string]bool{}
		for range 6 {
			_, _, body, err := get(t, client, lb+"/api/instance")
			if err == nil {
				seen[fmt.Sprint(body["instanceId"])] = true
			}
		}
		return len(seen) == 2
	})

	becameLeader := func() int {
		n := 0
		for _, p := range apps {
			n += len(p.logsMatching(map[string]any{"msg": "became leader"}))
		}
		return n
	}
	leaders := func() int { // leading now: became minus stopped
		n := becameLeader()
		for _, p := range apps {
			n -= len(p.logsMatching(map[string]any{"msg": "stopped leading"}))
		}
		return n
	}
	waitFor(t, 10*time.Second, "a leader", func() bool { return leaders() == 1 })
	direct := redisClient(t, rsrv.URL) // past the proxy's toxics

	faults := []struct {
		name       string
		start      func() (end func())
		maxLeaders int // new acquisitions allowed during the fault
	}{
		{"S3 hung", func() func() { return blackHole(t, s3Proxy) }, 0},
		{"Meilisearch hung", func() func() { return blackHole(t, meiliProxy) }, 0},
		{"Redis frozen (SIGSTOP)", func() func() { rsrv.Pause(); return rsrv.Resume }, 1},
		{"Redis +300 ms", func() func() { return latency(t, redisProxy, 300) }, 0},
		{"Redis +1,200 ms", func() func() { return latency(t, redisProxy, 1200) }, 0},
	}
	var table []string
	for _, f := range faults {
		leadersBefore := becameLeader()
		ctx, stop := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		var probes []probeSample
		var mu sync.Mutex
		for _, base := range []string{opsURLs[0], apiURLs[1]} {
			wg.Go(func() {
				for s := range sampleReadiness(ctx, base) {
					mu.Lock()
					probes = append(probes, s)
					mu.Unlock()
				}
			})
		}
		indexedBefore := meili.count("POST /indexes/orders/documents")
		end := f.start()
		answers := orderLoad(client, lb, 50, faultLen)
		indexedDuring := meili.count("POST /indexes/orders/documents") - indexedBefore
		end()
		// Each job kind has its own queue: with S3 hung, the receipts wait
		// and the search index keeps being written.
		if f.name == "S3 hung" && indexedDuring == 0 {
			t.Errorf("S3 hung: no order was indexed in Meilisearch during the fault")
		}
		stop()
		wg.Wait()

		r := tallyOrders(answers)
		notReady, firstSeen, p99 := readinessFigures(probes)
		table = append(table, fmt.Sprintf("| %s | %d of %d | %d | %d | %d of %d | %s | %d |", f.name, r.failed, len(answers),
			r.retryKeyed, r.retryPlain, notReady, len(probes), p99.Round(100*time.Microsecond), becameLeader()-leadersBefore))
		if r.failed > 0 {
			t.Errorf("%s: %d of %d orders through HAProxy failed; first: %s", f.name, r.failed, len(answers), r.firstFailure)
		}
		if notReady > 0 {
			t.Errorf("%s: readiness answered other than 200 %d times of %d; the first:\n%s", f.name, notReady, len(probes), strings.Join(firstSeen, "\n"))
		}
		if n := becameLeader() - leadersBefore; n > f.maxLeaders {
			var lines []string
			for _, p := range apps {
				for _, l := range p.logsMatching(map[string]any{"component": "leaderElection"}) {
					line := fmt.Sprint(l["time"], " ", l["instance"], " ", l["msg"])
					for _, k := range []string{"reason", "error"} {
						if v, ok := l[k]; ok {
							line += fmt.Sprintf(" %s=%v", k, v)
						}
					}
					lines = append(lines, line)
				}
			}
			t.Errorf("%s: leadership was taken %d times, want at most %d; the elections' lines:\n%s", f.name, n, f.maxLeaders, strings.Join(lines, "\n"))
		}
		// Between faults: both instances back in HAProxy's pool, and a
		// leadership lost in this fault taken again before the next one —
		// and renewed since this fault ended: a leader whose renewals all
		// failed during a freeze has little of its deadline left, and would
		// lose the lock in the next fault for what this one did.
		for i := range apps {
			waitReadiness(t, opsURLs[i], http.StatusOK, 10*time.Second)
		}
		waitFor(t, 20*time.Second, "one leader after "+f.name, func() bool { return leaders() == 1 })
		lockTTL := func() time.Duration { return direct.PTTL(context.Background(), leaderKey).Val() }
		since := lockTTL()
		waitFor(t, 20*time.Second, "the leader to renew its lock after "+f.name, func() bool {
			now := lockTTL()
			if now > since { // the TTL went up: a renewal
				return true
			}
			since = now
			return false
		})
	}
	t.Logf("each fault %s, 50 orders/s through HAProxy (check every 500 ms, fall 1), two instances:\n"+
		"| fault | failed orders | own 503 + Retry-After, with key | same, without key | readiness not 200 | readiness p99 | leader acquisitions |\n"+
		"|---|---|---|---|---|---|---|\n%s", faultLen, strings.Join(table, "\n"))
}

// orderTally counts a load run's answers. A failure is what the load
// balancer's trouble looks like: no answer, HAProxy's own 503 ("no server
// available", without Retry-After), or an error of the service. A 503 with
// Retry-After is the service's own fast refusal (an Idempotency-Key whose
// marker Redis cannot hold, or a dependency call past its budget on a
// starved machine): counted apart, by whether the request had a key.
type orderTally struct {
	failed, retryKeyed, retryPlain int
	firstFailure                   string
}

func tallyOrders(answers []keyedAnswer) orderTally {
	var r orderTally
	for _, a := range answers {
		switch {
		case a.status == http.StatusCreated:
		case a.status == http.StatusServiceUnavailable && a.retryAfter != "" && a.keyed:
			r.retryKeyed++
		case a.status == http.StatusServiceUnavailable && a.retryAfter != "":
			r.retryPlain++
		default:
			if r.failed++; r.firstFailure == "" {
				r.firstFailure = a.String()
			}
		}
	}
	return r
}

type keyedAnswer struct {
	answer
	keyed bool
}

// orderLoad posts orders at rate per second for d through base, every fifth
// with an Idempotency-Key, and returns every answer.
func orderLoad(client *http.Client, base string, rate int, d time.Duration) []keyedAnswer {
	var mu sync.Mutex
	var answers []keyedAnswer
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for i := range int(d.Seconds() * float64(rate)) {
		<-tick.C
		wg.Go(func() {
			key := ""
			if i%5 == 0 {
				key = fmt.Sprintf("fleet-%d-%d", time.Now().UnixNano(), i)
			}
			a := keyedAnswer{answer: postOrder(client, base, key), keyed: key != ""}
			mu.Lock()
			answers = append(answers, a)
			mu.Unlock()
		})
	}
	wg.Wait()
	return answers
}

type probeSample struct {
	status int
	took   time.Duration
	seen   string // of an answer other than 200: where, and what it said
}

// sampleReadiness asks base's /health/ready every 20 ms until ctx ends.
func sampleReadiness(ctx context.Context, base string) <-chan probeSample {
	out := make(chan probeSample)
	go func() {
		defer close(out)
		client := &http.Client{Timeout: 5 * time.Second}
		everyTick(ctx, 20*time.Millisecond, nil, func(context.Context) {
			start := time.Now()
			s := probeSample{}
			resp, err := client.Get(base + "/health/ready")
			if err != nil {
				s.seen = fmt.Sprintf("%s: %v", base, err)
			} else {
				body, _ := io.ReadAll(io.LimitReader(resp.Body, 2048))
				resp.Body.Close()
				if s.status = resp.StatusCode; s.status != http.StatusOK {
					s.seen = fmt.Sprintf("%s: %d %s", base, s.status, body)
				}
			}
			s.took = time.Since(start)
			out <- s
		})
	}()
	return out
}

// readinessFigures: how many answers were not 200 and the first three of
// them, and the p99 latency.
func readinessFigures(samples []probeSample) (notReady int, firstSeen []string, p99 time.Duration) {
	var took []time.Duration
	for _, s := range samples {
		if s.status != http.StatusOK {
			if notReady++; len(firstSeen) < 3 {
				firstSeen = append(firstSeen, s.seen)
			}
		}
		took = append(took, s.took)
	}
	if len(took) == 0 {
		return 0, nil, 0
	}
	slices.Sort(took)
	return notReady, firstSeen, took[len(took)*99/100]
}

// latency adds ms of latency to everything the proxy passes back; the
// returned func removes it.
func latency(t testing.TB, p *toxiproxy.Proxy, ms int) (restore func()) {
	t.Helper()
	if _, err := p.AddToxic("latency", "latency", "downstream", 1, toxiproxy.Attributes{"latency": ms}); err != nil {
		t.Fatalf("adding latency to %s: %v", p.Name, err)
	}
	return func() {
		if err := removeToxic(p, "latency"); err != nil {
			t.Errorf("removing the latency of %s: %v", p.Name, err)
		}
	}
}

// startHAProxy runs HAProxy in front of the API URLs with deploy/haproxy.cfg's
// health checks, each against the instance's ops port, and returns its URL.
func startHAProxy(t testing.TB, bin string, apis, opses []string) string {
	t.Helper()
	addr := freeTCPAddr(t)
	var servers strings.Builder
	for i := range apis {
		_, opsPort, _ := net.SplitHostPort(strings.TrimPrefix(opses[i], "http://"))
		fmt.Fprintf(&servers, "  server app%d %s check port %s\n", i+1, strings.TrimPrefix(apis[i], "http://"), opsPort)
	}
	cfg := fmt.Sprintf(`defaults
  mode http
  timeout connect 2s
  timeout client 30s
  timeout server 30s
  retries 2
  option redispatch
frontend api
  bind %s
  default_backend apps
backend apps
  option httpchk GET /health/ready
  http-check expect status 200
  timeout check 2s
  default-server inter 500ms fall 1 rise 2
%s`, addr, servers.String())
	dir := t.TempDir()
	path := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := startChild(exec.Command(bin, "-db", "-f", path), filepath.Join(dir, "haproxy.log"))
	if err != nil {
		t.Fatalf("starting haproxy: %v", err)
	}
	t.Cleanup(func() { p.stop(syscall.SIGTERM, 5*time.Second) })
	if err := p.waitReady(func(ctx context.Context) error { return dialable(ctx, addr) }); err != nil {
		t.Fatalf("haproxy: %v\n%s", err, logTail(filepath.Join(dir, "haproxy.log")))
	}
	return "http://" + addr
}

// count is how often call ("METHOD /path") reached the double.
func (d *meiliDouble) count(call string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, c := range d.calls {
		if c == call {
			n++
		}
	}
	return n
}

// waitDegraded waits until ops's readiness lists check as degraded, and
// fails if it ever answers other than 200 meanwhile: a shared dependency's
// trouble never takes the instance out of the load balancer. It returns how
// long it took.
func waitDegraded(t *testing.T, ops, check string, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	client := &http.Client{Timeout: 5 * time.Second}
	var last string
	waitFor(t, within, "readiness to list "+check+" as degraded", func() bool {
		code, _, body, err := get(t, client, ops+"/health/ready")
		last = fmt.Sprintf("%d %v %v", code, body, err)
		if err == nil && code != http.StatusOK {
			t.Fatalf("readiness answered %s while %s was in trouble", last, check)
		}
		degraded, _ := body["degraded"].([]any)
		return slices.Contains(degraded, any(check))
	})
	return time.Since(start)
}
