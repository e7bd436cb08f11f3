package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/sirupsen/logrus"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// ---------------------------------------------------------------------------
// Logs

// newLogger is the process logger. Before the config is loaded only
// KUMIKO_LOG_FORMAT decides the format; phase 1 applies the final one.
func newLogger(out io.Writer, format string) *logrus.Logger {
	log := logrus.New()
	log.SetOutput(out)
	setLogFormat(log, format)
	return log
}

func setLogFormat(log *logrus.Logger, format string) {
	var f logrus.Formatter = &logrus.TextFormatter{FullTimestamp: true, TimestampFormat: time.RFC3339Nano, DisableColors: true}
	if format == "json" {
		f = &logrus.JSONFormatter{TimestampFormat: time.RFC3339Nano}
	}
	log.SetFormatter(exitIsLast{Formatter: f, ended: new(atomic.Bool)})
}

// exitIsLast ends the log at the exit line (component=lifecycle event=exit):
// a drain left behind by a second signal or by the shutdown budget, the
// signal watcher and the listeners log nothing after it, so the exit line is
// what the last line says. logrus formats and writes a line under one lock,
// so no other line can slip in between the exit line and the end.
type exitIsLast struct {
	logrus.Formatter
	ended *atomic.Bool
}

func (f exitIsLast) Format(e *logrus.Entry) ([]byte, error) {
	if f.ended.Load() {
		return nil, nil // written as nothing
	}
	if e.Data["event"] == "exit" && e.Data["component"] == "lifecycle" {
		f.ended.Store(true)
	}
	return f.Formatter.Format(e)
}

// metrics holds every collector of the process on its own registry (no global
// default registry: two in-process instances in a test must not collide).
type metrics struct {
	registry *prometheus.Registry

	state             *prometheus.GaugeVec
	stateChanges      *prometheus.CounterVec
	phaseDuration     *prometheus.GaugeVec
	startupDuration   prometheus.Gauge
	shutdownStep      *prometheus.GaugeVec
	shutdownForced    prometheus.Counter
	httpInFlight      prometheus.Gauge
	httpRequests      *prometheus.CounterVec
	httpDuration      *prometheus.HistogramVec
	admissionLimit    prometheus.Gauge
	apiConns          prometheus.Gauge
	apiConnsMax       prometheus.Gauge
	apiConnsReclaimed *prometheus.CounterVec
	apiConnsRefused   prometheus.Counter
	admissionInFlight prometheus.Gauge
	admissionShed     prometheus.Counter
	admissionBaseline prometheus.Gauge
	readinessOK       *prometheus.GaugeVec
	readinessProbes   *prometheus.CounterVec
	panics            *prometheus.CounterVec
	connectAttempts   *prometheus.CounterVec
}

func newMetrics() *metrics {
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	f := promauto.With(registry) // each metric below is registered where it is made
	m := &metrics{
		registry: registry,
		state: f.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "lifecycle_state", Help: "1 for the current lifecycle state, 0 for the others.",
		}, []string{"state"}),
		stateChanges: f.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "lifecycle_state_changes_total", Help: "Lifecycle state transitions.",
		}, []string{"from", "to"}),
		phaseDuration: f.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "startup_phase_duration_seconds", Help: "How long each startup phase took in this process's boot.",
		}, []string{"phase"}),
		startupDuration: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "startup_duration_seconds", Help: "From process start to ready.",
		}),
		shutdownStep: f.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "shutdown_step_duration_seconds", Help: "How long each shutdown step took.",
		}, []string{"step"}),
		shutdownForced: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "shutdown_forced_total", Help: "In-flight requests force-closed because the drain timeout ran out.",
		}),
		httpInFlight: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "http_requests_in_flight", Help: "API requests being served now.",
		}),
		httpRequests: f.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "http_requests_total", Help: "API requests by route template and status code.",
		}, []string{"route", "code"}),
		httpDuration: f.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metricNamespace, Name: "http_request_duration_seconds", Help: "API request latency by route template.",
			Buckets: prometheus.DefBuckets,
		}, []string{"route"}),
		admissionLimit: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "api_concurrency_limit", Help: "API requests this instance works on at once before it sheds the next (admission.go); it follows their latency.",
		}),
		apiConns: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "api_connections", Help: "Connections open on the API port, event streams included.",
		}),
		apiConnsMax: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "api_connections_max", Help: "KUMIKO_API_MAX_CONNS: at this many open connections a new one takes the place of an idle or silent one, and the API port stops accepting while none is (0: no cap).",
		}),
		apiConnsReclaimed: f.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "api_connections_reclaimed_total", Help: "API connections closed at the cap to make room for a new one, by state: idle (keep-alive between requests) or silent (no request header for 500ms).",
		}, []string{"state"}),
		apiConnsRefused: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "api_connections_refused_total", Help: "API connections closed at once, unanswered, because their client address held KUMIKO_API_MAX_CONNS_PER_CLIENT already.",
		}),
		admissionInFlight: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "api_concurrency_in_flight", Help: "API requests admitted by the concurrency limit and not yet answered.",
		}),
		admissionShed: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "api_shed_total", Help: "API requests answered 503 with Retry-After at once because the concurrency limit was reached.",
		}),
		admissionBaseline: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "api_concurrency_baseline_seconds", Help: "The long-term median latency the concurrency limit compares each window's median with.",
		}),
		readinessOK: f.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "readiness_check_ok", Help: "1 when the readiness check passed at its last probe.",
		}, []string{"check"}),
		readinessProbes: f.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "readiness_probes_total", Help: "Readiness check runs in the background, by check.",
		}, []string{"check"}),
		panics: f.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "panics_total", Help: "Recovered panics, by where they happened.",
		}, []string{"component"}),
		connectAttempts: f.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "connect_attempts_total", Help: "Connection attempts of the connect phases, by target and result.",
		}, []string{"target", "result"}),
	}
	m.initKnownLabels()
	return m
}

// Label values known before anything happens. A labelled counter has no
// series until its first increment, so increase(...) cannot see that first
// one (increase needs two samples): every series named here starts at 0.
// The core's components are listed with their declarations (components.go),
// the blocks' by the root (newBlockMetrics), so a new component has its series
// without anyone remembering to list it twice.
func (m *metrics) initKnownLabels() {
	for from := range stateNames {
		for to := from + 1; to < len(stateNames); to++ { // transitions only go forward
			m.stateChanges.WithLabelValues(stateNames[from], stateNames[to])
		}
	}
	m.initComponentSeries(coreComponents())
}

// initComponentSeries starts the panics and connect series of components at 0.
func (m *metrics) initComponentSeries(components []component) {
	for _, c := range components {
		m.panics.WithLabelValues(c.name)
		for _, r := range []string{"ok", "failed"} {
			if c.connects {
				m.connectAttempts.WithLabelValues(c.name, r)
			}
		}
	}
}

func (m *metrics) setState(s State) {
	for i := range stateNames {
		v := 0.0
		if State(i) == s {
			v = 1
		}
		m.state.WithLabelValues(stateNames[i]).Set(v)
	}
}

func (m *metrics) stateChanged(from, to State) {
	m.setState(to)
	m.stateChanges.WithLabelValues(from.String(), to.String()).Inc()
}

func (m *metrics) phaseDone(rec phaseRecord) {
	m.phaseDuration.WithLabelValues(rec.Phase).Set(rec.took.Seconds())
}

// ---------------------------------------------------------------------------
// Traces

// tracing is the tracer provider and how to flush it. provider is what the
// readiness body shows: "otlp" or "noop".
type tracing struct {
	provider string
	tracer   trace.Tracer
	flush    func(context.Context) error // sends what is recorded so far; nil for noop
	shutdown func(context.Context) error // flushes, then closes the exporter
}

func noopTracing() tracing {
	return tracing{provider: "noop", tracer: noop.NewTracerProvider().Tracer(serviceName), shutdown: func(context.Context) error { return nil }}
}

// setupTracing exports spans over OTLP/HTTP when an endpoint is configured
// (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); the other
// standard OTEL_* variables are read by the exporter itself. Without an endpoint
// it is the noop provider: tracing must never be the reason a boot fails.
func setupTracing(ctx context.Context, getenv func(string) string, instanceID, version string) (tracing, error) {
	endpoint := getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
	if endpoint == "" && getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" {
		endpoint = strings.TrimSuffix(getenv("OTEL_EXPORTER_OTLP_ENDPOINT"), "/") + "/v1/traces"
	}
	if endpoint == "" {
		return noopTracing(), nil
	}
	// The exporter connects lazily; an endpoint that is malformed or does not
	// answer now would only fail silently at every flush. Say so at boot.
	shown := redactURL(endpoint) // credentials in the URL never reach a log line or a body
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		return noopTracing(), fmt.Errorf("OTLP endpoint %q is not a URL: using the noop provider", shown)
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), map[bool]string{true: "443", false: "80"}[u.Scheme == "https"])
	}
	conn, err := (&net.Dialer{Timeout: otlpDialTimeout}).DialContext(ctx, "tcp", host)
	if err != nil {
		return noopTracing(), fmt.Errorf("OTLP endpoint %s does not answer (%w): using the noop provider", shown, err)
	}
	conn.Close()
	exporter, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(endpoint))
	if err != nil {
		return noopTracing(), fmt.Errorf("creating the OTLP/HTTP exporter for %s: %w", shown, err)
	}
	res, err := resource.Merge(resource.Default(), resource.NewWithAttributes(semconv.SchemaURL,
		semconv.ServiceName(serviceName), semconv.ServiceVersion(version), semconv.ServiceInstanceID(instanceID)))
	if err != nil {
		return noopTracing(), fmt.Errorf("building the trace resource: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	return tracing{provider: "otlp", tracer: tp.Tracer(serviceName), flush: tp.ForceFlush, shutdown: tp.Shutdown}, nil
}

// otlpSecrets are the secret parts of the OTLP settings, which the exporter
// reads from the environment itself: the userinfo and query of the endpoints
// and every header value (OTEL_EXPORTER_OTLP_HEADERS is "key=value,..." and
// commonly carries an API key). The log's redact hook scrubs them.
func otlpSecrets(getenv func(string) string) []string {
	var secrets []string
	for _, name := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"} {
		u, err := url.Parse(getenv(name))
		if err != nil {
			continue
		}
		if u.User != nil {
			secrets = append(secrets, u.User.String())
			if p, ok := u.User.Password(); ok {
				secrets = append(secrets, p)
			} else {
				secrets = append(secrets, u.User.Username()) // a user alone is a token
			}
		}
		if u.RawQuery != "" {
			secrets = append(secrets, u.RawQuery)
		}
	}
	for _, name := range []string{"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"} {
		for pair := range strings.SplitSeq(getenv(name), ",") {
			_, v, ok := strings.Cut(pair, "=")
			if v = strings.TrimSpace(v); ok && v != "" {
				secrets = append(secrets, v)
				if dec, err := url.QueryUnescape(v); err == nil && dec != v {
					secrets = append(secrets, dec)
				}
			}
		}
	}
	// Longest first: a secret that contains another is scrubbed whole.
	slices.SortFunc(secrets, func(a, b string) int { return len(b) - len(a) })
	return secrets
}
