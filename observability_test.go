package main

import (
	"bytes"
	"compress/gzip"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/proto"
)

// otlpReceiver is a real OTLP/HTTP trace endpoint: it decodes the protobuf
// export requests the service sends and keeps the spans.
type otlpReceiver struct {
	srv *httptest.Server

	mu    sync.Mutex
	spans []receivedSpan
}

type receivedSpan struct {
	Name, TraceID, SpanID, ParentID string
}

func newOTLPReceiver(t testing.TB) *otlpReceiver {
	r := &otlpReceiver{}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		var body io.Reader = req.Body
		if req.Header.Get("Content-Encoding") == "gzip" {
			gz, err := gzip.NewReader(req.Body)
			if err != nil {
				http.Error(w, err.Error(), 400)
				return
			}
			body = gz
		}
		raw, _ := io.ReadAll(body)
		var export collectortrace.ExportTraceServiceRequest
		if err := proto.Unmarshal(raw, &export); err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		r.mu.Lock()
		for _, rs := range export.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					r.spans = append(r.spans, receivedSpan{Name: s.Name, TraceID: hex.EncodeToString(s.TraceId),
						SpanID: hex.EncodeToString(s.SpanId), ParentID: hex.EncodeToString(s.ParentSpanId)})
				}
			}
		}
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
		out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
		w.Write(out)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *otlpReceiver) named(prefix string) []receivedSpan {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []receivedSpan
	for _, s := range r.spans {
		if strings.HasPrefix(s.Name, prefix) {
			out = append(out, s)
		}
	}
	return out
}

// 2. After a boot and a SIGTERM the receiver holds the 16 phase spans under
// lifecycle.startup and the drain's step spans under lifecycle.shutdown:
// the flush at exit works.
func TestProcessTracesReachTheCollector(t *testing.T) {
	rcv := newOTLPReceiver(t)
	env := fastEnv(t, "OTEL_EXPORTER_OTLP_ENDPOINT="+rcv.srv.URL)
	p := startProc(t, env)
	ops, _ := p.waitReady()
	if _, _, body, _ := get(t, http.DefaultClient, ops+"/health/ready"); body["checks"].(map[string]any)["observability"].(map[string]any)["provider"] != "otlp" {
		t.Errorf("readiness shows %v, want provider otlp", body["checks"])
	}
	p.signal(syscall.SIGTERM)
	if code := p.wait(10 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}

	roots := rcv.named("lifecycle.startup")
	var root receivedSpan
	phases := map[string]receivedSpan{}
	for _, s := range roots {
		if s.Name == "lifecycle.startup" {
			root = s
		} else {
			phases[strings.TrimPrefix(s.Name, "lifecycle.startup.")] = s
		}
	}
	for _, name := range phaseOrder {
		s, ok := phases[name]
		if !ok {
			t.Errorf("no span for phase %s", name)
		} else if s.ParentID != root.SpanID || s.TraceID != root.TraceID {
			t.Errorf("phase %s is not a child of lifecycle.startup", name)
		}
	}
	shutdown := rcv.named("lifecycle.shutdown")
	spans := map[string]bool{}
	for _, s := range shutdown {
		spans[s.Name] = true
	}
	// Every step the drain logged, the last ones after the flush included.
	want := []string{"lifecycle.shutdown"}
	for _, line := range p.logsMatching(map[string]any{"msg": "lifecycle"}) {
		if step, ok := line["step"].(string); ok {
			want = append(want, "lifecycle.shutdown."+step)
		}
	}
	if len(want) < 10 || want[len(want)-1] != "lifecycle.shutdown.opsListener" {
		t.Fatalf("the drain logged steps %v, want every step through opsListener", want[1:])
	}
	for _, name := range want {
		if !spans[name] {
			t.Errorf("no span %s (got %v)", name, spans)
		}
	}
}

// 4. An OTLP endpoint that is invalid or does not answer: the boot reaches
// ready with the noop provider and a warning.
func TestProcessUnreachableCollectorFallsBackToNoop(t *testing.T) {
	for name, endpoint := range map[string]string{"unreachable": "http://" + freeTCPAddr(t), "invalid": "::not a url"} {
		t.Run(name, func(t *testing.T) {
			env := fastEnv(t, "OTEL_EXPORTER_OTLP_ENDPOINT="+endpoint)
			p := startProc(t, env)
			ops, _ := p.waitReady()
			p.waitLog(time.Second, map[string]any{"phase": "observability", "outcome": "warn"})
			code, _, body, _ := get(t, http.DefaultClient, ops+"/health/ready")
			obs := body["checks"].(map[string]any)["observability"].(map[string]any)
			if code != 200 || obs["provider"] != "noop" || obs["ok"] != true {
				t.Fatalf("readiness %d %v", code, obs)
			}
		})
	}
}

// 3. /metrics passes Prometheus' lint, carries the names operators alert on,
// and has sane values.
func TestMetricsLintAndValues(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	reg := s.app.metrics.registry
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
	families, _ := reg.Gather()
	byName := map[string]bool{}
	for _, f := range families {
		byName[f.GetName()] = true
	}
	for _, name := range []string{"kumiko_lifecycle_state", "kumiko_startup_phase_duration_seconds", "kumiko_startup_duration_seconds",
		"kumiko_http_requests_in_flight", "kumiko_readiness_check_ok", "kumiko_worker_heartbeat_age_seconds", "kumiko_leader",
		"kumiko_outbox_pending", "kumiko_outbox_delivered_total", "kumiko_shutdown_forced_total"} {
		if !byName[name] {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	if n := testutil.ToFloat64(s.app.metrics.state.WithLabelValues("ready")); n != 1 {
		t.Errorf("state gauge ready = %v", n)
	}
	var ones float64
	for _, st := range stateNames {
		ones += testutil.ToFloat64(s.app.metrics.state.WithLabelValues(st))
	}
	if ones != 1 {
		t.Errorf("state gauge is 1 for %v states, want exactly one", ones)
	}
	// 1. Every phase has its sample (and, in TestProcessTracesReachTheCollector, its span).
	for _, phase := range phaseOrder {
		if v := testutil.ToFloat64(s.app.metrics.phaseDuration.WithLabelValues(phase)); v <= 0 {
			t.Errorf("phase %s duration %v, want > 0", phase, v)
		}
	}
	if v := testutil.ToFloat64(s.app.metrics.startupDuration); v <= 0 {
		t.Errorf("startup duration %v", v)
	}
	// The boot counted panics, connects and heartbeats only under the
	// component table's names (a connect by a component not marked connects
	// would have had no series at 0).
	want := componentSeries()
	for key := range gatherComponentSeries(t, reg) {
		if !want[key] {
			t.Errorf("after boot, %s belongs to no component", key)
		}
	}
	// Shutdown steps too.
	s.stop(t)
	for _, step := range []string{"readiness", "linger", "closeListener", "sseClose", "inFlight", "outboxPoller", "jobsWorker", "redis", "db"} {
		if v := testutil.ToFloat64(s.app.metrics.shutdownStep.WithLabelValues(step)); v <= 0 {
			t.Errorf("shutdown step %s duration %v, want > 0", step, v)
		}
	}
}

// The alert rules are well-formed and every metric they use exists.
func TestAlertRulesUseRealMetrics(t *testing.T) {
	raw, err := os.ReadFile("k8s/prometheus-alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Groups []struct {
			Name  string
			Rules []struct {
				Alert, Expr, For string
				Labels           map[string]string
				Annotations      map[string]string
			}
		}
	}
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	if err := dec.Decode(&file); err != nil {
		t.Fatal(err)
	}
	m := newMetrics()
	// Children of vector metrics appear in Gather once they have a value.
	m.state.WithLabelValues("ready")
	m.readinessOK.WithLabelValues("db")
	newHeartbeats(nil, "x", time.Second, time.Second, newBlockMetrics(m).heartbeat, testReadiness(t, newTestLifecycle(), m, time.Second, time.Second)).RegisterHeartbeat(componentScheduler).last.Store(1)
	families, _ := m.registry.Gather()
	known := map[string]bool{}
	for _, f := range families {
		known[f.GetName()] = true
	}
	metricName := regexp.MustCompile(`kumiko_[a-z_]+`)
	n := 0
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			n++
			if r.Alert == "" || r.Expr == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" || r.Annotations["runbook"] == "" {
				t.Errorf("rule %+v lacks alert, expr, severity, summary or runbook", r)
			}
			if r.For != "" {
				if _, err := time.ParseDuration(r.For); err != nil {
					t.Errorf("%s: for %q: %v", r.Alert, r.For, err)
				}
			}
			for _, name := range metricName.FindAllString(r.Expr, -1) {
				if !known[name] {
					t.Errorf("%s uses %s, which the service does not export", r.Alert, name)
				}
			}
		}
	}
	if n < 4 {
		t.Fatalf("%d rules", n)
	}
}

// 4. Right after boot, /metrics already has every labelled counter whose
// labels are known at 0, so increase(...) alerts see the first event.
func TestProcessLabelledCountersStartAtZero(t *testing.T) {
	want := []string{`kumiko_lifecycle_state_changes_total{from="ready",to="draining"} 0`,
		`kumiko_jobs_total{kind="sleep",result="interrupted"} 0`, `kumiko_worker_heartbeats_total{result="failed",worker="scheduler"} 0`,
		`kumiko_connect_attempts_total{result="failed",target="leaderElection"} 0`}
	for _, c := range processComponents() {
		want = append(want, `kumiko_panics_total{component="`+c.String()+`"} 0`)
	}
	assertMetricsAfterBoot(t, want)
}

// assertMetricsAfterBoot boots a service and checks that /metrics has every
// one of the sample lines.
func assertMetricsAfterBoot(t *testing.T, want []string) {
	t.Helper()
	p := startProc(t, fastEnv(t))
	ops, _ := p.waitReady()
	_, raw := getBody(t, ops+"/metrics", "")
	text := string(raw)
	for _, line := range want {
		if !strings.Contains(text, line+"\n") {
			t.Errorf("/metrics after boot lacks %s", line)
		}
	}
	if t.Failed() {
		t.Logf("/metrics:\n%s", text)
	}
}

// 5. go-redis and River log through the process logger: structured, with the
// component, and scrubbed of secrets; nothing raw reaches stderr.
func TestProcessLibraryLogsAreStructured(t *testing.T) {
	env := fastEnv(t)
	redisServer := testRedis(t)
	env["REDIS_URL"] = redisServer.URL
	p := startProc(t, env)
	p.waitReady()
	redisServer.Stop() // go-redis logs its failed dials
	p.waitLog(10*time.Second, map[string]any{"component": "redis", "level": "warning"})
	p.signal(syscall.SIGTERM)
	p.wait(15 * time.Second)
	if strings.Contains(p.stderr.String(), "redis:") || strings.Contains(p.logText(), `"(not json)"`) {
		t.Errorf("unstructured library output:\nstderr: %s", p.stderr.String())
	}
}

func TestRiverLogsThroughTheScrubbedLogger(t *testing.T) {
	var out bytes.Buffer
	log := newLogger(&out, "json")
	log.AddHook(redactHook{secrets: []string{"hunter2-secret"}})
	riverLogger(log.WithField("component", "jobs")).With("attempt", 2).WithGroup("job").Warn("job failed", "error", "password hunter2-secret rejected")
	line := map[string]any{}
	if err := jsonDecode(&out, &line); err != nil {
		t.Fatalf("not one JSON line: %q (%v)", out.String(), err)
	}
	if line["component"] != "river" || line["level"] != "warning" || line["msg"] != "job failed" || line["attempt"] != float64(2) {
		t.Errorf("line %v", line)
	}
	if strings.Contains(out.String(), "hunter2-secret") || line["job.error"] != "password [redacted] rejected" {
		t.Errorf("the secret was not scrubbed: %s", out.String())
	}
}
