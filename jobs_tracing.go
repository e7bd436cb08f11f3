package main

import (
	"context"
	"encoding/json"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/sirupsen/logrus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// A job continues the trace of the events that triggered it: the delivery
// writes the trace context into the job's metadata (deliverySpans), and the
// worker middleware below starts the job's span from it.

// jobTraceLinks bounds the other events' traces a batch job links to (as
// OpenTelemetry's default span link limit does).
const jobTraceLinks = 128

// jobTrace is the trace a job's metadata carries: it continues the first
// event's and links the other events' of its batch.
type jobTrace struct {
	Traceparent string   `json:"traceparent"`
	Links       []string `json:"links,omitempty"`
}

// traceAndCountJobs is River worker middleware: every job runs in a span that
// continues the trace in its metadata, and is counted and timed.
//
// A job whose context was cancelled while the client stops (stopping) was
// interrupted by the drain: River puts it back without spending an attempt,
// and it is counted and logged as interrupted, not failed.
func traceAndCountJobs(tracer trace.Tracer, m *jobsMetrics, stopping func() bool, log *logrus.Entry) rivertype.Middleware {
	return river.WorkerMiddlewareFunc(func(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
		var meta jobTrace
		_ = json.Unmarshal(job.Metadata, &meta) // no metadata: a new trace
		links := make([]trace.Link, 0, len(meta.Links))
		for _, tp := range meta.Links {
			links = append(links, trace.LinkFromContext(withTraceparent(ctx, tp)))
		}
		ctx, span := tracer.Start(withTraceparent(ctx, meta.Traceparent), "job "+job.Kind, trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithLinks(links...), trace.WithAttributes(attribute.Int64("job.id", job.ID), attribute.Int("job.attempt", job.Attempt)))
		defer span.End()
		start := time.Now()
		err := doInner(ctx)
		result := "ok"
		switch {
		case err != nil && ctx.Err() != nil && stopping():
			result = "interrupted"
			span.SetAttributes(attribute.Bool("job.interrupted", true))
			log.WithFields(logrus.Fields{"event": "job_interrupted", "job_id": job.ID, "kind": job.Kind, "attempt": job.Attempt}).
				Info("job interrupted by the drain: back in the queue, no attempt spent")
		case err != nil:
			result = "failed"
			span.SetStatus(codes.Error, err.Error())
		}
		m.worked.WithLabelValues(job.Kind, result).Inc()
		m.duration.WithLabelValues(job.Kind).Observe(time.Since(start).Seconds())
		return err
	})
}

// jobsMetrics is what the jobs worker adds to /metrics.
type jobsMetrics struct {
	worked   *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

func newJobsMetrics(r prometheus.Registerer) *jobsMetrics {
	f := promauto.With(r)
	return &jobsMetrics{
		worked: f.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "jobs_total", Help: "Jobs worked by this instance, by kind and result.",
		}, []string{"kind", "result"}),
		duration: f.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metricNamespace, Name: "job_duration_seconds", Help: "How long jobs took, by kind.", Buckets: prometheus.DefBuckets,
		}, []string{"kind"}),
	}
}

// initKinds starts the counter of every kind the features work at 0 (phase
// 5, once the kinds are known): increase(...) then sees a kind's first job.
func (m *jobsMetrics) initKinds(kinds []string) {
	for _, k := range kinds {
		for _, r := range []string{"ok", "failed", "interrupted"} {
			m.worked.WithLabelValues(k, r)
		}
	}
}
