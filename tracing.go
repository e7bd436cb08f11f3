package main

import (
	"context"
	"strconv"

	"github.com/labstack/echo/v4"
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
