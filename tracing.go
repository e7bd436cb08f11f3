package main

import (
	"context"
	"encoding/json"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/sirupsen/logrus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// One trace follows a write from the HTTP request that made it, through its
// outbox event (the trace context is stored with the event), to the jobs the
// delivery inserts (the delivery span's context rides in the job's metadata)
// — also when another instance delivers or works it. W3C trace context is
// passed explicitly; there is no global propagator.
var traceContext = propagation.TraceContext{}

// traceparentOf is ctx's span as a W3C traceparent ("" without one).
func traceparentOf(ctx context.Context) string {
	carrier := propagation.MapCarrier{}
	traceContext.Inject(ctx, carrier)
	return carrier["traceparent"]
}

// withTraceparent continues the trace a stored traceparent names.
func withTraceparent(ctx context.Context, traceparent string) context.Context {
	if traceparent == "" {
		return ctx
	}
	return traceContext.Extract(ctx, propagation.MapCarrier{"traceparent": traceparent})
}

// traceRequests starts a server span per API request, continuing the
// caller's trace from its traceparent header. The span is named after the
// route template, never the raw path.
func traceRequests(tracer trace.Tracer) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			req := c.Request()
			ctx := traceContext.Extract(req.Context(), propagation.HeaderCarrier(req.Header))
			ctx, span := tracer.Start(ctx, req.Method+" "+c.Path(), trace.WithSpanKind(trace.SpanKindServer),
				trace.WithAttributes(attribute.String("http.request.method", req.Method), attribute.String("http.route", c.Path())))
			defer span.End()
			c.SetRequest(req.WithContext(ctx))
			err := next(c)
			if err != nil {
				c.Error(err)
			}
			status := c.Response().Status
			span.SetAttributes(attribute.Int("http.response.status_code", status))
			if status >= 500 {
				span.SetStatus(codes.Error, strconv.Itoa(status))
			}
			return nil
		}
	}
}

// jobTraceLinks bounds the other events' traces a batch job links to (as
// OpenTelemetry's default span link limit does).
const jobTraceLinks = 128

// jobTrace is the trace a job's metadata carries: it continues the first
// event's and links the other events' of its batch.
type jobTrace struct {
	Traceparent string   `json:"traceparent"`
	Links       []string `json:"links,omitempty"`
}

// deliverySpans marks each event's delivery inside its writer's trace and
// returns the metadata that carries them into the job the events trigger.
func deliverySpans(ctx context.Context, tracer trace.Tracer, evs []outboxEvent) []byte {
	var t jobTrace
	for i, ev := range evs {
		ctx, span := tracer.Start(withTraceparent(ctx, ev.Traceparent), "outbox.deliver "+ev.Type,
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attribute.Int64("outbox.event_id", ev.ID)))
		switch {
		case i == 0:
			t.Traceparent = traceparentOf(ctx)
		case len(t.Links) < jobTraceLinks:
			t.Links = append(t.Links, traceparentOf(ctx))
		}
		span.End()
	}
	meta, _ := json.Marshal(t)
	return meta
}

// traceAndCountJobs is River worker middleware: every job runs in a span that
// continues the trace in its metadata, and is counted and timed.
//
// A job whose context was cancelled while the client stops (stopping) was
// interrupted by the drain: River puts it back without spending an attempt,
// and it is counted and logged as interrupted, not failed.
func traceAndCountJobs(tracer trace.Tracer, m *metrics, stopping func() bool, log *logrus.Entry) rivertype.Middleware {
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
		m.jobs.WithLabelValues(job.Kind, result).Inc()
		m.jobDuration.WithLabelValues(job.Kind).Observe(time.Since(start).Seconds())
		return err
	})
}
