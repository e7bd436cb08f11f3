package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/labstack/echo/v4"
	"github.com/labstack/echo/v4/middleware"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// What every request passes through, and the one shape of an error.

// newEcho is the echo instance every listener uses: JSON errors, panics
// answered with a 500 for that request only.
func newEcho(log *logrus.Logger, m *metrics, c component) *echo.Echo {
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.HTTPErrorHandler = jsonErrorHandler(c.log(log))
	e.Use(recoverPanics(log, m, c))
	return e
}

// recoverPanics answers a panicking handler with a 500, logged with its stack
// and counted; the process goes on serving.
func recoverPanics(log *logrus.Logger, m *metrics, c component) echo.MiddlewareFunc {
	return middleware.RecoverWithConfig(middleware.RecoverConfig{
		DisableStackAll: true,
		LogErrorFunc: func(ec echo.Context, err error, stack []byte) error {
			m.panics.WithLabelValues(c.String()).Inc()
			c.log(log).WithFields(logrus.Fields{"route": ec.Path(), "stack": string(stack)}).WithError(err).Error("handler panicked")
			return echo.NewHTTPError(http.StatusInternalServerError, "internal error")
		},
	})
}

// ---------------------------------------------------------------------------
// Middleware

// observeRequests counts requests by route template (never the raw path: its
// cardinality is unbounded) and tracks the requests in flight.
func observeRequests(m *metrics) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			start := time.Now()
			if err := next(c); err != nil {
				c.Error(err)
			}
			route := c.Path()
			if route == "" {
				route = "unmatched"
			}
			m.httpRequests.WithLabelValues(route, strconv.Itoa(c.Response().Status)).Inc()
			m.httpDuration.WithLabelValues(route).Observe(time.Since(start).Seconds())
			return nil
		}
	}
}

// trackInFlight counts the API requests being served, for the drain's
// force-close warning and for kumiko_http_requests_in_flight.
func trackInFlight(n *atomic.Int64, m *metrics) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			n.Add(1)
			m.httpInFlight.Inc()
			defer func() {
				n.Add(-1)
				m.httpInFlight.Dec()
			}()
			return next(c)
		}
	}
}

// withDeadline bounds a request's context, and with it every dependency call
// the handler makes on it. Only for handlers that neither stream nor wait by
// design (/api/slow).
func withDeadline(d time.Duration) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			ctx, cancel := context.WithTimeout(c.Request().Context(), d)
			defer cancel()
			c.SetRequest(c.Request().WithContext(ctx))
			return next(c)
		}
	}
}

// admitWhenServing answers 503 with Retry-After while the process is not
// serving. During the linger no check is needed: keep-alives are off from its
// first moment and the listener closes after it, so the only requests that
// still arrive are the ones the linger is there to serve. With
// KUMIKO_DRAIN_REJECT=retry-after the port stays open past the linger, and
// from then on (rejecting) a new request is told to retry elsewhere.
func admitWhenServing(lc *Lifecycle, rejecting *atomic.Bool) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			if s := lc.State(); s == StateStarting || s == StateStopped {
				c.Response().Header().Set("Retry-After", "1")
				return apiError(http.StatusServiceUnavailable, "unavailable", "instance is "+s.String())
			}
			if rejecting.Load() {
				c.Response().Header().Set("Retry-After", "1")
				return apiError(http.StatusServiceUnavailable, "draining", "this instance is shutting down; retry, another one answers")
			}
			return next(c)
		}
	}
}

// requireBearer compares SHA-256 digests of the presented token and of the
// expected one: both are always 32 bytes, so the comparison time does not
// tell the token's length (ConstantTimeCompare returns at once on a length
// mismatch).
func requireBearer(token string) echo.MiddlewareFunc {
	want := sha256.Sum256([]byte(token))
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			presented, _ := bearerToken(c.Request())
			got := sha256.Sum256([]byte(presented))
			if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
				c.Response().Header().Set(echo.HeaderWWWAuthenticate, "Bearer")
				return apiError(http.StatusUnauthorized, "unauthorized", "admin routes need Authorization: Bearer <KUMIKO_ADMIN_TOKEN>")
			}
			return next(c)
		}
	}
}

// bearerToken is the token of an Authorization: Bearer header, and whether
// there is one. The scheme is matched case-insensitively and may be followed
// by more than one space (RFC 9110 §11.1, §11.4): "bearer x" is the same
// credential as "Bearer x". An empty token is no token.
func bearerToken(r *http.Request) (string, bool) {
	scheme, token, found := strings.Cut(r.Header.Get(echo.HeaderAuthorization), " ")
	token = strings.TrimLeft(token, " ")
	if !found || !strings.EqualFold(scheme, "Bearer") || token == "" {
		return "", false
	}
	return token, true
}

// ---------------------------------------------------------------------------
// Errors: every error body is {"error":{"code","message"}}.

type errorBody struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// apiError is an error a handler returns to answer with status and a JSON body.
func apiError(status int, code, message string) error {
	return echo.NewHTTPError(status, errorBody{Code: code, Message: message})
}

func jsonErrorHandler(log *logrus.Entry) echo.HTTPErrorHandler {
	return func(err error, c echo.Context) {
		if c.Response().Committed {
			return
		}
		status, body := http.StatusInternalServerError, errorBody{Code: "internal", Message: "internal error"}
		var he *echo.HTTPError
		if errors.As(err, &he) {
			status = he.Code
			switch msg := he.Message.(type) {
			case errorBody:
				body = msg
			default:
				body = errorBody{Code: codeFor(status), Message: fmt.Sprint(msg)}
			}
		} else if dependencyUnavailable(err) || errors.Is(err, context.Canceled) {
			// A dependency that restarts or hangs is no bug here, and the client
			// should come back; a request whose client left gets the same answer.
			status, body = http.StatusServiceUnavailable, errorBody{Code: "unavailable", Message: "a dependency did not answer in time; retry shortly"}
			c.Response().Header().Set("Retry-After", "1")
			log.WithField("route", c.Path()).WithError(err).Warn("dependency unavailable")
		} else {
			// Not an answer a handler chose: log it, tell the client nothing internal.
			log.WithField("route", c.Path()).WithError(err).Error("request failed")
		}
		if err := c.JSON(status, map[string]errorBody{"error": body}); err != nil {
			log.WithError(err).Debug("writing the error response")
		}
	}
}

// dependencyUnavailable reports an error that is no fault of the request: a
// dependency that did not answer within the request's budget, a database
// that restarts or refuses connections, a statement the server cancelled
// (statement_timeout, lock_timeout). The API answers it 503 with
// Retry-After, never 500.
func dependencyUnavailable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "57014", "55P03", "53300", "53400": // query_canceled, lock_not_available, too_many_connections, configuration_limit_exceeded
			return true
		}
		return serverGoingAway(pgErr.Code)
	}
	var netErr net.Error
	return errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err) || connectionLost(err) ||
		errors.Is(err, redis.ErrPoolTimeout) || (errors.As(err, &netErr) && netErr.Timeout())
}

func codeFor(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "bad_request"
	case http.StatusUnauthorized:
		return "unauthorized"
	case http.StatusNotFound:
		return "not_found"
	case http.StatusMethodNotAllowed:
		return "method_not_allowed"
	case http.StatusRequestTimeout:
		return "request_timeout"
	case http.StatusTooManyRequests:
		return "rate_limited"
	case http.StatusRequestEntityTooLarge:
		return "payload_too_large"
	case http.StatusServiceUnavailable:
		return "unavailable"
	case http.StatusInternalServerError:
		return "internal"
	}
	return "error"
}
