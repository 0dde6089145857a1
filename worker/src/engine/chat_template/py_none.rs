//! Python's `None` for the arguments `apply_chat_template` passes as None
//! (`tools`, `documents`). minijinja's own none iterates as an empty list
//! and prints as "none"; Python's raises TypeError when a template loops
//! over it or takes its length (though jinja2's `map`, `select` and the like
//! give nothing for it), and prints as "None". Tool-use templates
//! that loop over `tools` unguarded therefore fail in transformers when no
//! tools are given, and must fail here too rather than render a prompt no
//! Python server would.
use minijinja::value::{Object, ObjectRepr, Rest, ValueOrKwargs};
use minijinja::{Environment, Error, State, Value};
use std::fmt;
use std::sync::Arc;

/// The value templates see.
#[derive(Debug)]
struct PyNone;

impl Object for PyNone {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        // Plain and not enumerable: iterating it, `length`, `map`, `select`
        // and the like are errors, as for Python's None.
        ObjectRepr::Plain
    }

    fn is_true(self: &Arc<Self>) -> bool {
        false
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("None")
    }
}

/// A Python `None`.
pub fn value() -> Value {
    Value::from_object(PyNone)
}

/// Whether `v` is a Python `None` made by [`value`].
pub fn is(v: &Value) -> bool {
    v.downcast_object_ref::<PyNone>().is_some()
}

/// The `none` test: minijinja's none or Python's.
pub fn test_none(v: &Value) -> bool {
    v.is_none() || is(v)
}

/// jinja2's `map`, `select`, `reject`, `selectattr` and `rejectattr` yield
/// nothing for a falsy value (they start with `if value:`), None included,
/// where iterating it would raise: registered over minijinja's own, they
/// give an empty list for Python's None and are minijinja's otherwise.
pub fn register_sequence_filters(env: &mut Environment<'static>) {
    use minijinja::filters;
    type Args = Rest<ValueOrKwargs>;
    type Test = Option<String>;
    macro_rules! nothing_for_none {
        ($name:literal, |$state:ident, $value:ident $(, $arg:ident: $ty:ty)*| $body:expr) => {
            env.add_filter(
                $name,
                |$state: &mut State, $value: Value $(, $arg: $ty)*| -> Result<Vec<Value>, Error> {
                    if is(&$value) {
                        return Ok(Vec::new());
                    }
                    $body
                },
            );
        };
    }
    nothing_for_none!("map", |state, value, args: Args| filters::map(
        state, value, args
    ));
    nothing_for_none!("select", |state, value, test: Test, args: Args| {
        filters::select(state, value, test.map(Into::into), args)
    });
    nothing_for_none!("reject", |state, value, test: Test, args: Args| {
        filters::reject(state, value, test.map(Into::into), args)
    });
    nothing_for_none!(
        "selectattr",
        |state, value, attr: String, test: Test, args: Args| {
            filters::selectattr(state, value, attr.into(), test.map(Into::into), args)
        }
    );
    nothing_for_none!(
        "rejectattr",
        |state, value, attr: String, test: Test, args: Args| {
            filters::rejectattr(state, value, attr.into(), test.map(Into::into), args)
        }
    );
}
