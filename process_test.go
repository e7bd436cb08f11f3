package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// testBinary is the service built once by TestMain, so process-level tests
// send real signals to a real process and read its exit code.
var testBinary string

func TestMain(m *testing.M) {
	flag.Parse()
	if fuzz, list := flag.Lookup("test.fuzz"), flag.Lookup("test.list"); fuzz != nil && fuzz.Value.String() != "" || list != nil && list.Value.String() != "" {
		// Fuzzing (scripts/test.sh, a few seconds): the fuzz targets are pure
		// functions, and every fuzz worker runs TestMain, so a build here would
		// eat the fuzz time. Listing the tests runs none.
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "kumiko-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "temp dir:", err)
		os.Exit(1)
	}
	testBinary = filepath.Join(dir, serviceName)
	build := exec.Command("go", "build", "-o", testBinary, ".")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building the service:", err)
		os.Exit(1)
	}
	code := m.Run()
	stopTestServices()
	os.RemoveAll(dir)
	os.Exit(code)
}

// testMasterKey is a fixed, valid master key for tests (never a real secret).
var testMasterKey = base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, 32))

// fastEnv is the environment of a service that boots against real Postgres and
// Redis with every timing shrunk so a whole lifecycle takes milliseconds. A
// test's own settings follow as KEY=value, as in os.Environ, and win.
func fastEnv(t testing.TB, settings ...string) map[string]string {
	t.Helper()
	dir := t.TempDir()
	env := map[string]string{
		"DATABASE_URL":                    testPostgres(t),
		"REDIS_URL":                       testRedis(t).URL,
		"KUMIKO_MASTER_KEY":               testMasterKey,
		"KUMIKO_HTTP_ADDR":                "127.0.0.1:0",
		"KUMIKO_OPS_ADDR":                 "127.0.0.1:0",
		"KUMIKO_LOG_FORMAT":               "json",
		"KUMIKO_MIGRATIONS_MODE":          "auto-apply",
		"KUMIKO_LINGER":                   "200ms",
		"KUMIKO_DRAIN_TIMEOUT":            "5s",
		"KUMIKO_SHUTDOWN_TIMEOUT":         "10s",
		"KUMIKO_CONNECT_RETRY_BASE":       "50ms",
		"KUMIKO_READINESS_CHECK_INTERVAL": "100ms",
		"KUMIKO_READINESS_PROBE_TIMEOUT":  "500ms",
		"KUMIKO_OUTBOX_POLL_INTERVAL":     "100ms",
		"KUMIKO_OUTBOX_RETRY_BASE":        "50ms",
		"KUMIKO_INSTANCE_ID":              "test-" + strings.ReplaceAll(t.Name(), "/", "-"),
		// Tests fire bursts of up to a few hundred requests at a cold
		// instance to test caching, retries or the drain; on a slow
		// machine they are all in flight at once, and the limiter's
		// starting limit would shed some. Its own tests set it.
		"KUMIKO_API_CONCURRENCY_MIN": "500",
		// What a drain that went wrong leaves behind stays in the test's
		// own directory (diagnostics_process_test.go reads it there).
		"KUMIKO_DIAGNOSTICS_DIR": filepath.Join(dir, "diagnostics"),
		"KUMIKO_TERMINATION_LOG": filepath.Join(dir, "termination-log"),
	}
	for _, kv := range settings {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			t.Fatalf("fastEnv: %q is not KEY=value", kv)
		}
		env[k] = v
	}
	return env
}

// proc is the service running as a child process.
type proc struct {
	t      testing.TB
	cmd    *exec.Cmd
	stderr bytes.Buffer
	exited chan struct{}
	code   int

	mu    sync.Mutex
	lines []map[string]any
	grew  chan struct{} // closed and replaced whenever a log line arrives
}

func startProc(t testing.TB, env map[string]string, args ...string) *proc {
	t.Helper()
	return startBinary(t, testBinary, env, args...)
}

// startBinary runs bin, a build of this service or of a copy of it, as startProc does.
func startBinary(t testing.TB, bin string, env map[string]string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Dir = t.TempDir() // no kumiko.config.yaml there: the environment is the whole config
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	p := &proc{t: t, cmd: cmd, exited: make(chan struct{}), grew: make(chan struct{})}
	cmd.Stderr = &p.stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting the service: %v", err)
	}
	go p.readLogs(stdout)
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.exited
		if t.Failed() {
			t.Logf("service (exit code %d), last 80 log lines:\n%s\nstderr:\n%s", p.code, lastLines(p.logText(), 80), lastLines(p.stderr.String(), 20))
		}
	})
	return p
}

func (p *proc) readLogs(r io.Reader) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := map[string]any{}
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			line = map[string]any{"msg": "(not json)", "raw": sc.Text()}
		}
		p.mu.Lock()
		p.lines = append(p.lines, line)
		close(p.grew)
		p.grew = make(chan struct{})
		p.mu.Unlock()
	}
	err := p.cmd.Wait()
	p.code = p.cmd.ProcessState.ExitCode()
	if err != nil && p.code == 0 {
		p.code = -1
	}
	close(p.exited)
}

// waitLog waits for the first log line that matches every key=value of want.
func (p *proc) waitLog(timeout time.Duration, want map[string]any) map[string]any {
	p.t.Helper()
	deadline := time.After(timeout)
	for seen := 0; ; {
		p.mu.Lock()
		lines, grew := p.lines, p.grew
		p.mu.Unlock()
		for ; seen < len(lines); seen++ {
			if matches(lines[seen], want) {
				return lines[seen]
			}
		}
		select {
		case <-grew:
		case <-p.exited:
			p.mu.Lock()
			n := len(p.lines)
			p.mu.Unlock()
			if seen == n {
				p.t.Fatalf("service exited (code %d) before logging %v", p.code, want)
			}
		case <-deadline:
			p.t.Fatalf("no log line %v within %s", want, timeout)
		}
	}
}

// logsMatching returns every line so far that matches want.
func (p *proc) logsMatching(want map[string]any) []map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []map[string]any
	for _, l := range p.lines {
		if matches(l, want) {
			out = append(out, l)
		}
	}
	return out
}

func matches(line, want map[string]any) bool {
	for k, v := range want {
		if fmt.Sprint(line[k]) != fmt.Sprint(v) {
			return false
		}
	}
	return true
}

func (p *proc) logText() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var b strings.Builder
	for _, l := range p.lines {
		j, _ := json.Marshal(l)
		b.Write(j)
		b.WriteByte('\n')
	}
	return b.String()
}

// addr is the address a listener ("ops" or "api") reported when it bound.
func (p *proc) addr(component string) string {
	p.t.Helper()
	return "http://" + p.waitLog(10*time.Second, map[string]any{"msg": "listening", "component": component})["addr"].(string)
}

// bootBudget is how long a test waits for a child's boot (to ready, or to a
// line it logs on the way). A boot takes 1–3 s on an idle machine; with both
// cores busy and four process-level tests at once, one fresh database's 15
// migrations took 9.2 s, so a boot of 12 s is possible, and the budget is
// well above it.
const bootBudget = 45 * time.Second

// waitReady waits for the state change to ready and returns the ops and API base URLs.
func (p *proc) waitReady() (ops, api string) {
	p.t.Helper()
	p.waitLog(bootBudget, map[string]any{"event": "state_changed", "to": "ready"})
	return p.addr("ops"), p.addr("api")
}

func (p *proc) signal(sig os.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("sending %s: %v", sig, err)
	}
}

// wait returns the exit code, failing the test if the process outlives timeout.
func (p *proc) wait(timeout time.Duration) int {
	p.t.Helper()
	select {
	case <-p.exited:
		return p.code
	case <-time.After(timeout):
		p.t.Fatalf("service still running after %s", timeout)
		return -1
	}
}

// get fetches url and decodes a JSON body (if any) into a map.
func get(t *testing.T, client *http.Client, url string) (int, http.Header, map[string]any, error) {
	t.Helper()
	resp, err := client.Get(url)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	body := map[string]any{}
	raw, _ := io.ReadAll(resp.Body)
	_ = json.Unmarshal(raw, &body)
	return resp.StatusCode, resp.Header, body, nil
}

// roundTrip sends req with client (nil: http.DefaultClient) and returns the
// answer with its whole body; a request that gets no answer fails the test.
// Call it from the test's goroutine.
func roundTrip(t testing.TB, client *http.Client, req *http.Request) (*http.Response, []byte) {
	t.Helper()
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading the body: %v", req.Method, req.URL, err)
	}
	return resp, body
}

// getBody GETs url, with auth as its Authorization header ("" for none), and
// returns the answer with its whole body.
func getBody(t testing.TB, url, auth string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	return roundTrip(t, nil, req)
}

// scrapeMetric reads one sample ("name{labels}") from a /metrics endpoint; 0 when absent.
func scrapeMetric(base, sample string) (float64, error) {
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if rest, ok := strings.CutPrefix(line, sample+" "); ok {
			var v float64
			_, err := fmt.Sscan(rest, &v)
			return v, err
		}
	}
	return 0, nil
}

func jsonDecode(r io.Reader, v any) error { return json.NewDecoder(r).Decode(v) }

func redisClient(t testing.TB, url string) *redis.Client {
	opts, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

func sharedPool(t testing.TB, env map[string]string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), env["DATABASE_URL"])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// waitFor waits until cond holds, polling every 10 ms, and fails the test
// after timeout. Wait for an event (a log line, a channel, a stream's
// frame) where the program offers one; poll where it offers none.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if !poll(timeout, 10*time.Millisecond, cond) {
		t.Fatalf("timed out after %s waiting for %s", timeout, what)
	}
}

// poll calls cond every interval until it holds or timeout has passed, and
// reports whether it held; a caller that fails prints what cond last saw.
// It is the suite's one polling loop, for states the program announces by
// no event: a query's result, a metric, a probe's answer, the runtime's
// goroutines, a child's /proc entry. Unlike waitFor it may run on any
// goroutine.
func poll(timeout, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(interval) // real time: what cond reads offers no event to wait on
	}
	return true
}

// pace calls send every interval until ctx ends or send returns false: a
// client with a rate of its own. It is the suite's one paced loop; the load
// a process test puts on the service is a rate in real time.
func pace(ctx context.Context, interval time.Duration, send func() bool) {
	for ctx.Err() == nil && send() {
		time.Sleep(interval) // real time: the client's pace, not a wait for anything
	}
}
